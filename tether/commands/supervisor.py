"""Start, watch and stop a set of child processes together, leaving no orphan behind.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the supervisor, which then
stops children in order) with ``PR_SET_PDEATHSIG`` so the kernel ends it if the supervisor dies
abruptly. Output goes to one log file per child. Stopping is SIGTERM, a grace period, then SIGKILL to
the child's whole process group (torchrun's ranks, vLLM's workers). A child marked ``restartable`` that
dies is started again after a back-off (doubling), up to ``max_restarts`` times; only a child that keeps
dying — or one not restartable — ends the group, with its name, code and its own last error line
(:mod:`tether.commands.child_errors`: the failing rank's, not torchrun's banner). A child can also say that a
restart cannot help (``gave_up``: a config its data does not fit, a run that cannot train): then it ends the
group at once, with that reason. So does a child that dies before it got going (its ``progress`` did not move
in this life: the learner wrote no step, a server never became ready) with the same error as its previous
life: a model that cannot load fails the same way every time, and three more lives of it only hid the cause
behind a minute and a half of restarts. A child that got going and then crashed keeps the restart policy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tether.commands.child_errors import last_error, read_life, same_error, without_banner
from tether.logs import get_logger
from tether.orphans import die_with_parent

log = get_logger(__name__)


@dataclass
class ChildSpec:
    name: str
    cmd: Sequence[str]
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    # When a "primary" child exits 0 the whole group has finished its job.
    primary: bool = False
    # Started again (this command, or ``cmd`` when None) when it dies, up to the supervisor's restart limit.
    restart_cmd: Sequence[str] | None = None
    restartable: bool = False
    # Asked when the child exits non-zero: the reason it gave up when it left one (a restart cannot help, so
    # none is made), else None.
    gave_up: Callable[[], str | None] | None = None
    # How far the child has got (the learner's last step, how often a server became ready), read when a life
    # starts and when it dies: unchanged means it died before it got going. None: not watched.
    progress: Callable[[], object] | None = None


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again
    log_offset: int = 0  # where this life's output starts in the (appended) log file
    progress_at_start: object = None
    previous_error: str | None = None  # the error line the previous life ended with


class ChildFailed(RuntimeError):
    def __init__(
        self,
        name: str,
        code: int,
        log_file: Path,
        *,
        restarts: int = 0,
        reason: str | None = None,
        error: str | None = None,
        repeated: bool = False,
        log_offset: int = 0,
    ) -> None:
        self.name, self.code, self.log_file, self.restarts, self.reason = name, code, log_file, restarts, reason
        self.error, self.repeated = error, repeated
        if reason is not None:  # the child said why: that, not its log's tail
            super().__init__(f"{name} exited with code {code}: {reason} (see {log_file})")
            return
        if repeated:
            super().__init__(
                f"{name} failed before it got going, the same way as in its previous life, so it is not started "
                f"again (a restart cannot fix it): {error} (see {log_file})"
            )
            return
        again = (
            f" (after {restarts} restart{'s' * (restarts != 1)}: the restart limit, run.max_restarts)"
            if restarts
            else ""
        )
        if error is not None:
            super().__init__(f"{name} exited with code {code}{again}: {error} (see {log_file})")
            return
        super().__init__(f"{name} exited with code {code}{again}; see {log_file}\n{tail(log_file, log_offset)}")


def tail(path: Path, offset: int = 0, lines: int = 15) -> str:
    """The last ``lines`` of ``path`` after ``offset``, less torchrun's banner (which names no cause)."""
    text = without_banner(read_life(path, offset))[-lines:]
    return "\n".join(f"  | {line}" for line in text)


class Supervisor:
    def __init__(self, *, grace_s: float = 20.0, max_restarts: int = 0, backoff_s: float = 2.0) -> None:
        self.children: list[Child] = []
        self.grace_s = grace_s
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.restarts: list[tuple[str, int]] = []  # (child, exit code) of every restart, in order

    def start(self, spec: ChildSpec) -> Child:
        offset, progress = _life_start(spec)
        child = Child(spec, self._spawn(spec, spec.cmd), log_offset=offset, progress_at_start=progress)
        self.children.append(child)
        log.info("child_started", child=spec.name, pid=child.proc.pid, log=str(spec.log_file))
        return child

    def _spawn(self, spec: ChildSpec, cmd: Sequence[str]) -> subprocess.Popen[bytes]:
        out = spec.log_file.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        out.close()
        return proc

    def poll(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.proc.poll() is not None:
                return child
        return None

    def wait(
        self,
        *,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 1.0,
        until: Callable[[], bool] | None = None,
    ) -> int:
        """Block until a primary child exits 0 (returns 0) or any child fails (raises ChildFailed); with
        ``until``, also return 0 as soon as it answers True (restarts and failures are handled meanwhile)."""
        next_tick = time.monotonic()
        while True:
            if until is not None and until():
                return 0
            for child in list(self.children):
                if child.restart_at is not None:
                    if time.monotonic() >= child.restart_at:
                        self._restart(child)
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                if code == 0 and child.spec.primary:
                    return 0
                if code != 0:
                    self._died(child, code)
                    continue
                self.children.remove(child)  # a non-primary child that finished its job
            if on_tick is not None and time.monotonic() >= next_tick:
                next_tick += tick_s
                with contextlib.suppress(Exception):
                    on_tick()
            time.sleep(0.1)

    def _died(self, child: Child, code: int) -> None:
        """A child exited non-zero: raise :class:`ChildFailed` when this ends the group, else schedule a restart."""
        spec = child.spec
        reason = spec.gave_up() if spec.gave_up is not None else None
        # A child killed by a signal (the OOM killer, a SIGKILL) left no word on it: an error line in its log
        # is something else it said earlier, not the cause.
        error = last_error(read_life(spec.log_file, child.log_offset)) if code > 0 else None
        fail = {"restarts": child.restarts, "error": error, "log_offset": child.log_offset}
        if reason is None and same_error(error, child.previous_error) and not _got_going(child):
            raise ChildFailed(spec.name, code, spec.log_file, repeated=True, **fail)
        if reason is not None or not (spec.restartable and child.restarts < self.max_restarts):
            raise ChildFailed(spec.name, code, spec.log_file, reason=reason, **fail)
        child.previous_error = error
        _signal_group(child.proc, signal.SIGKILL)  # what the dead leader left behind
        delay = min(60.0, self.backoff_s * 2**child.restarts)
        child.restart_at = time.monotonic() + delay
        log.warning("child_died_restarting", child=spec.name, code=code, error=error, in_s=delay,
                    restart=child.restarts + 1, of=self.max_restarts)  # fmt: skip

    def _restart(self, child: Child) -> None:
        code = child.proc.returncode
        child.restarts += 1
        child.restart_at = None
        child.log_offset, child.progress_at_start = _life_start(child.spec)
        child.proc = self._spawn(child.spec, child.spec.restart_cmd or child.spec.cmd)
        self.restarts.append((child.spec.name, code if code is not None else -1))
        log.warning("child_restarted", child=child.spec.name, pid=child.proc.pid, restart=child.restarts)

    def stop_all(self) -> None:
        """SIGTERM every child (reverse start order), wait the grace period, SIGKILL what remains."""
        for child in reversed(self.children):
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in reversed(self.children):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                log.warning("child_killed", child=child.spec.name, after_s=self.grace_s)
            # the group may hold grandchildren (ranks, engine workers) even when the leader exited
            _signal_group(child.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
        self.children.clear()


def _life_start(spec: ChildSpec) -> tuple[int, object]:
    """Where a new life's output starts in the child's log, and its progress then."""
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        offset = spec.log_file.stat().st_size
    except OSError:
        offset = 0
    return offset, _progress(spec)


def _progress(spec: ChildSpec) -> object:
    if spec.progress is None:
        return None
    try:
        return spec.progress()
    except Exception:  # a file being written: counts as no news
        return None


def _got_going(child: Child) -> bool:
    """Whether this life of ``child`` moved its progress (a child whose progress is not watched always did)."""
    return child.spec.progress is None or _progress(child.spec) != child.progress_at_start


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
