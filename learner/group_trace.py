"""``groups.jsonl``: when and where each group the learner trained on was generated, one JSON line per group.

The learner's own metrics say how long it waited and computed; they cannot say how fast the rollout side
generated, which is the rate ``tether plan --from-run`` needs to replay a run (:mod:`tether.commands.plan.calibrate`).
Every trajectory carries its server id and the wall-clock start and end of its generation, so rank 0
writes them here after the step that trained on them: the planner takes each server's busy time (the
union of its groups' generation intervals) and tokens from these lines, and the completion lengths as
the length distribution. Best-effort like every telemetry sink: a failing write warns once and stops.
"""

from __future__ import annotations

import json
from pathlib import Path

from buffer import BufferedGroup
from tether.logs import get_logger

log = get_logger(__name__)


class GroupTrace:
    def __init__(self, path: Path) -> None:
        self.path: Path | None = path

    def write(self, batch: list[BufferedGroup], *, step: int) -> None:
        if self.path is None or not batch:
            return
        lines = []
        for b in batch:
            trajs = b.group.trajectories
            started = [t.started_at for t in trajs if t.started_at]
            finished = [t.finished_at for t in trajs if t.finished_at]
            row = {
                "step": step,
                "staleness": b.staleness,
                "server": trajs[0].server_id if trajs else "",
                "started": min(started) if started else None,
                "finished": max(finished) if finished else None,
                "lengths": [len(t.completion_token_ids) for t in trajs],
                "prompt": len(trajs[0].prompt_token_ids) if trajs else 0,
            }
            lines.append(json.dumps(row, separators=(",", ":")))
        try:
            with self.path.open("a") as f:
                f.write("\n".join(lines) + "\n")
        except OSError as e:
            log.warning("group_trace_disabled", path=str(self.path), error=repr(e))
            self.path = None
