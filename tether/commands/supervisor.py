"""Start, watch and stop a set of child processes together, leaving no orphan behind.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the supervisor, which then
stops children in order) with ``PR_SET_PDEATHSIG`` so the kernel ends it if the supervisor dies
abruptly. Output goes to one log file per child. Stopping is SIGTERM, a grace period, then SIGKILL to
the child's whole process group (torchrun's ranks, vLLM's workers). A child marked ``restartable`` that
dies is started again after a back-off (doubling), up to ``max_restarts`` times; only a child that keeps
dying — or one not restartable — ends the group, with its name, code and log tail. A child can also say
that a restart cannot help (``gave_up``: a config its data does not fit, a run that cannot train): then it
ends the group at once, with that reason.
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


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again


class ChildFailed(RuntimeError):
    def __init__(self, name: str, code: int, log_file: Path, *, restarts: int = 0, reason: str | None = None) -> None:
        self.name, self.code, self.log_file, self.restarts, self.reason = name, code, log_file, restarts, reason
        if reason is not None:  # the child said why: that, not its log's tail
            super().__init__(f"{name} exited with code {code}: {reason} (see {log_file})")
            return
        again = (
            f" (after {restarts} restart{'s' * (restarts != 1)}: the restart limit, run.max_restarts)"
            if restarts
            else ""
        )
        super().__init__(f"{name} exited with code {code}{again}; see {log_file}\n{tail(log_file)}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join(f"  | {line}" for line in text)


class Supervisor:
    def __init__(self, *, grace_s: float = 20.0, max_restarts: int = 0, backoff_s: float = 2.0) -> None:
        self.children: list[Child] = []
        self.grace_s = grace_s
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.restarts: list[tuple[str, int]] = []  # (child, exit code) of every restart, in order

    def start(self, spec: ChildSpec) -> Child:
        child = Child(spec, self._spawn(spec, spec.cmd))
        self.children.append(child)
        log.info("child_started", child=spec.name, pid=child.proc.pid, log=str(spec.log_file))
        return child

    def _spawn(self, spec: ChildSpec, cmd: Sequence[str]) -> subprocess.Popen[bytes]:
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
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
                    reason = child.spec.gave_up() if child.spec.gave_up is not None else None
                    if reason is not None or not (child.spec.restartable and child.restarts < self.max_restarts):
                        raise ChildFailed(child.spec.name, code, child.spec.log_file, restarts=child.restarts,
                                          reason=reason)  # fmt: skip
                    _signal_group(child.proc, signal.SIGKILL)  # what the dead leader left behind
                    delay = min(60.0, self.backoff_s * 2**child.restarts)
                    child.restart_at = time.monotonic() + delay
                    log.warning("child_died_restarting", child=child.spec.name, code=code, in_s=delay,
                                restart=child.restarts + 1, of=self.max_restarts)  # fmt: skip
                    continue
                self.children.remove(child)  # a non-primary child that finished its job
            if on_tick is not None and time.monotonic() >= next_tick:
                next_tick += tick_s
                with contextlib.suppress(Exception):
                    on_tick()
            time.sleep(0.1)

    def _restart(self, child: Child) -> None:
        code = child.proc.returncode
        child.restarts += 1
        child.restart_at = None
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


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
