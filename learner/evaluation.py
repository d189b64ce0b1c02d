"""Evaluation during training: held-out prompts at the current policy version, scored by rollout servers.

Learner rank 0 issues a round (``val_before_train``, then every ``test_freq`` steps and after the last
step) onto the validation stream (:mod:`buffer.evaluation`) — never the prompts stream, so evaluation is
outside admission control, the trajectories stream and the training books. Collection is
**asynchronous**: training goes on while servers generate, and each step polls for results; a round is
logged once all its prompts are back, or when ``val_timeout_s`` runs out (``val/missing`` counts the
prompts that never came back). Its row in metrics.jsonl / TensorBoard carries the learner step whose
weights it evaluated (``val/version`` is their policy version), so curves line up with training even
though the row is written a few steps later. At the end the learner waits (at most ``val_timeout_s``)
for rounds still out, so the final evaluation is not lost.

Metrics of a round, with k = ``val_n`` samples per prompt and a sample *passing* when its reward is ≥ 1:
``val/reward_mean`` (over samples), ``val/mean@k`` (over prompts, of each prompt's mean reward),
``val/pass@k`` (share of prompts with at least one passing sample), ``val/pass@1`` (unbiased, mean of
c/n), ``val/best@k`` (mean of each prompt's best reward). Key names keep a literal ``k`` (``val/k``
says what it is) so plots and dashboards need no per-run key. Each data source of the evaluation set
(its ``data_source`` column, or the demo task) also gets its own ``val/<source>/<metric>``.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from buffer.evaluation import ValidationQueue, ValResult
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.metrics import MetricsLogger
from tether.tasks import demo_rows
from tether.v1.trajectory_pb2 import Prompt

log = get_logger(__name__)

DEMO_VAL_PROMPTS = 128
PER_SOURCE = ("val/reward_mean", "val/mean@k", "val/pass@k", "val/pass@1", "val/best@k", "val/prompts", "val/missing")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass (Chen et al., 2021): 1 − C(n−c, k)/C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(results: list[ValResult], *, k: int, expected: int) -> dict[str, float]:
    """Round metrics from per-prompt results (failed prompts and prompts never answered count as missing)."""
    done = [r for r in results if r.rewards and not r.error]
    out: dict[str, float] = {"val/k": float(k), "val/prompts": float(len(done)),
                             "val/missing": float(max(0, expected - len(done)))}  # fmt: skip
    if not done:
        return out
    samples = [x for r in done for x in r.rewards]
    out["val/reward_mean"] = sum(samples) / len(samples)
    out["val/mean@k"] = sum(sum(r.rewards) / len(r.rewards) for r in done) / len(done)
    out["val/best@k"] = sum(max(r.rewards) for r in done) / len(done)
    passing = [(len(r.rewards), sum(x >= 1.0 for x in r.rewards)) for r in done]
    out["val/pass@1"] = sum(pass_at_k(n, c, 1) for n, c in passing) / len(done)
    out["val/pass@k"] = sum(pass_at_k(n, c, min(k, n)) for n, c in passing) / len(done)
    out["val/tokens_mean"] = sum(r.tokens for r in done) / len(samples)
    versions = [v for r in done for v in r.versions]
    if versions:
        out["val/generated_version_min"] = float(min(versions))
    return out


def load_val_prompts(cfg: TetherConfig) -> list[Prompt]:
    """The evaluation set: the held-out split of a demo task, or the first rows of a dataset (rows over
    ``max_prompt_length`` skipped when ``filter_overlong_prompts``; every data source checked for a scorer)."""
    from learner.data import demo_prompt
    from learner.datasets import open_table
    from learner.rows import RowFormat, check_scorers

    lc, what = cfg.learner, "learner.val_data_path"
    spec = lc.val_data_path
    if spec.startswith("demo:"):
        task = spec.split(":", 1)[1]
        check_scorers(cfg, {task}, what=what, spec=spec, source_key="task")
        rows = itertools.islice(demo_rows(task, seed=cfg.run.seed, split="val"), lc.val_max_prompts or DEMO_VAL_PROMPTS)
        return [demo_prompt(row, i, prompt_id=f"val{i}") for i, row in enumerate(rows)]
    table = open_table(spec, what=what, split="test")
    fmt = RowFormat(cfg, what=what)
    fmt.check_columns(table, spec)
    kept, _ = fmt.scan(table, spec)
    prompts: list[Prompt] = []
    for index, row in enumerate(table.rows(0)):
        if len(prompts) == (lc.val_max_prompts or table.num_rows):
            break
        if kept is None or kept[index]:
            # dataset_index is the index within the round: results are matched back by it
            prompts.append(fmt.prompt(row, len(prompts), prompt_id=f"val{len(prompts)}"))
    check_scorers(cfg, {p.reward_context["data_source"] for p in prompts if "data_source" in p.reward_context},
                  what=what, spec=spec, source_key=lc.data_source_key)  # fmt: skip
    return prompts


def summarize_by_source(results: list[ValResult], prompts: list[Prompt], *, k: int) -> dict[str, float]:
    """``val/<source>/<metric>`` for each data source of the evaluation set (its prompts only)."""
    sources = [p.reward_context.get("data_source") for p in prompts]
    out: dict[str, float] = {}
    for source in sorted({s for s in sources if s is not None}):
        mine = [r for r in results if 0 <= r.index < len(sources) and sources[r.index] == source]
        part = summarize(mine, k=k, expected=sources.count(source))
        out.update({f"val/{source}/{key[4:]}": part[key] for key in PER_SOURCE if key in part})
    return out


@dataclass
class _Round:
    step: int
    version: int
    issued_at: float
    results: dict[int, ValResult] = field(default_factory=dict)


class Evaluator:
    """Rank 0 only. ``maybe_start(step, version)`` after each publish; ``poll()`` every step; ``finish()``."""

    def __init__(self, cfg: TetherConfig, client, keys, metrics: MetricsLogger) -> None:
        self.cfg, self.client, self.keys, self.metrics = cfg, client, keys, metrics
        self.prompts = load_val_prompts(cfg)
        self.queue = ValidationQueue(client, keys, claim_idle_ms=cfg.buffer.claim_idle_ms)
        self.rounds: dict[int, _Round] = {}
        self.last: dict[str, float] = {}
        log.info("evaluation_on", prompts=len(self.prompts), test_freq=cfg.learner.test_freq, k=cfg.learner.val_n)

    def due(self, step: int) -> bool:
        lc = self.cfg.learner
        if step == 0:
            return lc.val_before_train
        return bool(lc.test_freq) and (step % lc.test_freq == 0 or step == lc.total_steps)

    def maybe_start(self, step: int, version: int) -> None:
        if not self.due(step) or any(r.step == step for r in self.rounds.values()):
            return
        lc = self.cfg.learner
        round_id = time.time_ns()  # unique across restarts, so a resumed run never mixes in old results
        max_tokens = lc.val_max_tokens or self.cfg.rollout.max_tokens
        self.queue.issue(self.prompts, round_id=round_id, version=version, n=lc.val_n,
                         temperature=lc.val_temperature, max_tokens=max_tokens)  # fmt: skip
        self.rounds[round_id] = _Round(step, version, time.monotonic())
        log.info("evaluation_issued", step=step, version=version, prompts=len(self.prompts))

    def poll(self) -> list[dict[str, float]]:
        """Log every round that is complete or past its timeout; their metrics (also for tests)."""
        try:
            for r in self.queue.take_results():
                if r.round in self.rounds:
                    self.rounds[r.round].results[r.index] = r
        except Exception as e:  # evaluation never stops training: a Redis hiccup is retried next step
            log.warning("evaluation_poll_failed", error=repr(e))
            return []
        done = []
        now = time.monotonic()
        for round_id, rnd in sorted(self.rounds.items()):
            complete = len(rnd.results) >= len(self.prompts)
            if complete or now - rnd.issued_at > self.cfg.learner.val_timeout_s:
                done.append(self._close(round_id, now))
        return done

    def _close(self, round_id: int, now: float) -> dict[str, float]:
        rnd = self.rounds.pop(round_id)
        results = list(rnd.results.values())
        out = summarize(results, k=self.cfg.learner.val_n, expected=len(self.prompts))
        out.update(summarize_by_source(results, self.prompts, k=self.cfg.learner.val_n))
        out.update({"val/version": float(rnd.version), "val/latency_s": now - rnd.issued_at})
        self.metrics.log(out, step=rnd.step)
        self.last = {"val_step": rnd.step, **out}
        try:  # for `tether status`
            self.client.hset(self.keys.learner, mapping={
                "val_step": str(rnd.step), "val_k": str(out["val/k"]),
                "val_mean_at_k": str(out.get("val/mean@k", "")), "val_pass_at_k": str(out.get("val/pass@k", "")),
                "val_missing": str(out["val/missing"]),
            })  # fmt: skip
        except Exception as e:
            log.warning("evaluation_status_failed", error=repr(e))
        log.info("evaluation_done", step=rnd.step, **{k.split("/", 1)[1]: v for k, v in out.items()})
        if out["val/missing"]:
            log.warning("evaluation_incomplete", step=rnd.step, missing=out["val/missing"])
        return out

    def finish(self) -> None:
        """Wait for the rounds still out (at most ``val_timeout_s`` each), then log them."""
        while self.rounds:
            self.poll()
            if self.rounds:
                time.sleep(0.2)
