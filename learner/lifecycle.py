"""How a learner lifetime begins after a restart and how it ends when asked to stop.

**Stopping.** SIGINT and SIGTERM (what Ctrl-C, ``kill``, systemd, container runtimes and ``tether up``'s
supervisor send) do not interrupt a step: they set a flag that rank 0 reads between steps and
broadcasts with the next batch, so every rank leaves the loop after the same step, the groups that step
trained on are acknowledged, and the final checkpoint is written. A second signal is the impatient
one: it raises ``KeyboardInterrupt`` at once.

**Versions on resume.** The policy version counts weight publications and must never go backwards, or
rollout servers would refuse the next update and keep tagging tokens with versions the learner has not
reached. A checkpoint can be older than what was published after it (the learner crashed after later
steps, or the filesystem holds a later snapshot): then the resumed learner continues from the newest
version anyone has seen, plus one, and publishes its checkpoint's weights under it at once, so every
server — already running or started later from the snapshot — moves to the weights the learner really
has. When nothing newer than the checkpoint exists but no snapshot of its version does either (gloo
without snapshots), the checkpoint's weights are written as that version's snapshot, so servers started
fresh from ``model.path`` catch up instead of generating from the base weights.

**A fresh start on a run with a history** is refused (:func:`refuse_fresh_start`): a learner started
without ``--resume`` at step 0 and version 0 against a Redis where the run already published later
versions (servers hold them, admission counts from them) would issue no prompt and wait forever, and
training over an old run's checkpoints would mix two runs in one folder.
"""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass

from tether.logs import get_logger

log = get_logger(__name__)


class RunHasHistory(RuntimeError):
    """A learner started without ``--resume`` on a run that already trained."""


def refuse_fresh_start(run_id: str, *, published: int, checkpoint_step: int | None, folder: str) -> None:
    """Raise :class:`RunHasHistory` saying what to do when run ``run_id`` already published a version or
    checkpointed; return when it is new."""
    if published <= 0 and checkpoint_step is None:
        return
    seen = [f"policy version {published} published in its Redis"] if published > 0 else []
    seen += [f"checkpoints up to step {checkpoint_step} in {folder}"] if checkpoint_step is not None else []
    raise RunHasHistory(
        f"run {run_id} already trained ({'; '.join(seen)}): continue it with --resume (`tether up --resume "
        f"{folder}`, or `tether learner ... --resume`), or start a new run under another run.run_id"
    )


class StopSignal:
    """Records SIGINT/SIGTERM for a clean stop between steps; a second signal interrupts at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Not the main thread (an embedded test): no handler, so no clean stop either.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:  # type: ignore[no-untyped-def]
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        log.warning("stop_requested", signal=self.received, action="finishing this step, then checkpointing")

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class ResumePlan:
    version: int
    """The version the learner continues from."""
    publish: bool
    """Publish the checkpoint's weights under ``version`` before the first step."""
    reason: str


def plan_resume_version(checkpoint: int, *, published: int, snapshot: int | None) -> ResumePlan:
    """The version to continue from, given the checkpoint's, the one in Redis and the newest snapshot's."""
    seen = max(published, snapshot if snapshot is not None else -1)
    if seen > checkpoint:
        return ResumePlan(seen + 1, True, f"version {seen} was published after the checkpoint (v{checkpoint})")
    if snapshot is None or snapshot < checkpoint:
        return ResumePlan(checkpoint, checkpoint > 0, f"no snapshot of v{checkpoint} for servers to catch up from")
    return ResumePlan(checkpoint, False, "the snapshot and Redis agree with the checkpoint")
