"""The buffer's rules, apart from how bytes are laid out: admission, staleness, and which counter a drop
goes to.

These are the numbers DESIGN.md promises (AReaL's admission bound, "staleness = learner version − the
oldest token version"), so each has exactly one definition: the prompt feed admits with
:func:`admission_allowance`, and the trajectory reader (per group) and the learner's sample builder (per
trajectory) both measure lag with :func:`staleness_of`, so the histogram the reader books and the
``buffer/staleness_*`` the learner logs can never disagree on the same tokens.
"""

from __future__ import annotations

from tether.trajectory import PROMPT_GROUP_PREFIX

DROPPED_STALE = "dropped_stale"
"""Counter of stale groups born from an issued prompt; each gives one admission slot back."""

DROPPED_STALE_ENV = "dropped_stale_env"
"""Counter of stale groups no prompt admitted (custom environments' episodes)."""


def admission_allowance(issued: int, *, version: int, prompts_per_version: int, max_staleness: int) -> int:
    """Prompts that may be issued now under AReaL's rule ``issued ≤ (max_staleness + version + 1)·B``.

    With ``max_staleness = 0`` exactly one version's worth is ever ahead of the learner: synchronous RL.
    """
    if prompts_per_version <= 0:
        raise ValueError(f"prompts_per_version must be positive, got {prompts_per_version}")
    if max_staleness < 0 or version < 0:
        raise ValueError(f"max_staleness and version must be >= 0, got {max_staleness} and {version}")
    return max(0, (max_staleness + version + 1) * prompts_per_version - issued)


def staleness_of(oldest_version: int, current_version: int) -> int:
    """Versions the learner is ahead of the oldest token of a group (or of one trajectory); a group with no
    tokens (``oldest_version`` -1), or one tagged with a version the learner has not reached (a learner
    resumed from an older checkpoint), counts as fresh."""
    if oldest_version < 0:
        return 0
    return max(0, current_version - oldest_version)


def stale_counter(group_id: str) -> str:
    """The counter a stale group goes to. Admission control (:mod:`buffer.prompts`) gives back one slot per
    :data:`DROPPED_STALE`: only groups born from an issued prompt may count there, or stale episode groups
    would loosen the bound for good."""
    return DROPPED_STALE if group_id.startswith(PROMPT_GROUP_PREFIX) else DROPPED_STALE_ENV
