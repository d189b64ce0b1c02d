"""How much work each local process takes on: prompts in flight on a rollout server, threads per process.

Both follow the step rather than fixed numbers. A learner step consumes ``train_batch_size`` prompts and
admission control lets rollout run ``max_staleness`` versions ahead, so about
``train_batch_size × (max_staleness + 1)`` prompts can usefully be in flight; fewer starves the engine's
batch (it decodes 16 rows where the step needs 64), more than the engine batches at once (``max_num_seqs``
rows, ``n`` per prompt) only queue. A user's explicit ``rollout.prompt_workers`` wins.

Threads: with ``max_staleness: 0`` generation and training alternate, so the learner's phase may use
every core (issue 23's probe on an idle 2-core machine: learner compute 1.63 → 0.85 s per step at 256
wide with two threads instead of one). The rollout server keeps its even share: at these sizes decoding
with two threads was slower than with one (same probe) — small-batch decoding is a chain of small
kernels. Nor do extra learner threads pay for a narrow model: below :data:`PARALLEL_MIN_HIDDEN` its
kernels are too small for an OpenMP team (bf16, quiet: the 64 wide × 2 layers sync step ~10 % slower
with two learner threads; 256 wide × 4: 0.92 → 0.75 s per step with two), so a narrow model's learner
keeps its even share too. With overlap (``max_staleness > 0``) both run at once, so the cores are split
evenly; oversubscribing them (two threads each on two cores) was slower, 1.62 → 2.24 s per step. A
split weighted by each phase's measured time would differ from the even one only with more cores than
processes, and needs the run's own timings; it is not done here. On a machine shared with other work,
several intra-op threads per process can be far slower than one (their OpenMP barriers wait on
descheduled threads): set ``OMP_NUM_THREADS=1`` there. A user's ``OMP_NUM_THREADS`` wins for every process.

No torch import here: the launcher and the config-time checks use it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from tether.config import TetherConfig

Role = Literal["learner", "rollout"]


def prompt_workers(cfg: TetherConfig) -> int:
    """Prompts one rollout server works on at once: the user's ``rollout.prompt_workers``, or derived.

    Derived: the step's prompts times the versions rollout may run ahead, split over the local servers,
    capped at the prompts the engine batches together (``max_num_seqs // n``), at least 1.
    """
    rc = cfg.rollout
    if rc.prompt_workers is not None:
        return rc.prompt_workers
    wanted = cfg.learner.train_batch_size * (cfg.algorithm.max_staleness + 1)
    per_server = math.ceil(wanted / max(1, rc.num_servers))
    engine_cap = max(1, rc.engine.max_num_seqs // max(1, rc.n))
    return max(1, min(per_server, engine_cap))


def with_prompt_workers(cfg: TetherConfig) -> TetherConfig:
    """``cfg`` with ``rollout.prompt_workers`` resolved to a number (what a rollout server runs with)."""
    if cfg.rollout.prompt_workers is not None:
        return cfg
    rollout = cfg.rollout.model_copy(update={"prompt_workers": prompt_workers(cfg)})
    return cfg.model_copy(update={"rollout": rollout})


def local_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


PARALLEL_MIN_HIDDEN = 256
"""Models narrower than this train on the learner's even share of cores, in sync mode too (see above)."""


def hidden_size(model_path: str) -> int | None:
    """``hidden_size`` from the model folder's ``config.json`` (a multimodal one's ``text_config``); None
    when there is no such file or field (a hub id not downloaded yet: then the model counts as wide)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    return int(size) if isinstance(size, int) else None


def thread_counts(cfg: TetherConfig, *, cores: int) -> dict[Role, int]:
    """Intra-op threads of each learner rank and each rollout server started on this machine."""
    learners, servers = cfg.learner.nproc_per_node, max(0, cfg.rollout.num_servers)
    even = max(1, cores // max(1, learners + servers))
    if cfg.algorithm.max_staleness == 0:
        # Phases alternate: the learner's turn has the machine to itself, if its kernels can use it.
        width = hidden_size(cfg.model.path) if cfg.model.path else None
        if width is None or width >= PARALLEL_MIN_HIDDEN:
            return {"learner": max(1, cores // learners), "rollout": even}
    return {"learner": even, "rollout": even}


def thread_env(
    cfg: TetherConfig, role: Role, *, cores: int | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment additions for one local process: ``OMP_NUM_THREADS`` unless the user set it."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return {}
    n = thread_counts(cfg, cores=local_cores() if cores is None else cores)[role]
    return {"OMP_NUM_THREADS": str(n)}
