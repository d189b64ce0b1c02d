"""No orphan outlives the process that started it: a child asks the kernel to signal it when its parent
dies, however the parent dies (SIGKILL included). Used by every process that starts helpers (``tether up``'s
supervisor, the embedded Redis, the test and bench harnesses)."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn`` (runs in the child between fork and exec): the kernel sends ``sig`` to the child
    when its parent dies, however it dies. Linux only; elsewhere a no-op."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
