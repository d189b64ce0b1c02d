"""``tether plan`` for several runs on one rollout fleet: the fair-share gate, the shared simulation against
the one-run one, token shares under contention, an idle run's share going to the other, and the command
line with two configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import simpy
import yaml

from tether.commands.cli import main
from tether.commands.plan.fleet import FleetSpec, Lengths
from tether.commands.plan.gate import Gate
from tether.commands.plan.project import project
from tether.commands.plan.rates import load_rates
from tether.commands.plan.runs import SharedRun, project_runs, simulate_runs
from tether.commands.plan.sim import simulate
from tether.config import load_config


def _config(share: float = 1.0):
    return load_config(None, ["--rollout.n", "8", "--learner.train_batch_size", "32", "--rollout.max_tokens", "512",
                              "--algorithm.max_staleness", "2", "--rollout.share", str(share)])  # fmt: skip


def test_the_gate_grants_by_share_and_gives_no_credit_for_idle_time() -> None:
    """One slot, groups of 10 tokens taking 1 s each, shares 1:3, four groups of each run asking at a time; run 0
    asks only from t = 200."""
    env = simpy.Environment()
    gate = Gate(env, capacity=1, shares=[1.0, 3.0])
    grants: list[tuple[int, float]] = []

    def asker(run: int, start: float):
        yield env.timeout(start)
        while True:
            turn = gate.turn(run)
            if not turn.granted.triggered:
                yield turn.granted
            grants.append((run, env.now))
            yield env.timeout(1.0)
            gate.release(turn, 10.0)

    for _ in range(4):
        env.process(asker(0, 200.0))
        env.process(asker(1, 0.0))
    env.run(until=400)
    before = [r for r, t in grants if t < 200]
    after = [r for r, t in grants if t >= 200]
    assert before == [1] * 200  # alone, run 1 takes every slot
    # Run 0 comes back at run 1's virtual time, not 2000 tokens behind it: a quarter from then on, no burst.
    assert after.count(0) == pytest.approx(50, abs=2)
    assert after[:8].count(0) <= 3


@pytest.mark.parametrize("seed", range(6))
def test_one_run_on_the_fleet_path_is_the_one_run_simulation(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    eta = int(rng.integers(0, 4))
    f = FleetSpec(
        train_batch_size=int(rng.integers(1, 9)), n=int(rng.integers(1, 5)), max_staleness=eta,
        sync_every=int(rng.integers(1, 3)), servers=int(rng.integers(1, 4)), slots_per_server=int(rng.integers(1, 6)),
        server_tokens_per_s=rng.uniform(100, 3000), learner_step_s=rng.uniform(0.01, 0.3),
        learner_tokens_per_s=float("inf"), sync_s=rng.uniform(0, 0.1),
        lengths=Lengths(mean=rng.uniform(5, 100), cv=rng.uniform(0, 2), max_tokens=300),
        inflight=str(rng.choice(["keep", "drain"])),
    )  # fmt: skip
    alone = simulate(f, steps=25, warmup=eta + 2, seed=seed)
    shared = simulate_runs([SharedRun(f, share=2.0, steps=25, warmup=eta + 2)], capacity=f.slots_per_server, seed=seed)
    assert shared.runs == [alone]
    assert shared.token_share == [1.0]


def test_one_config_projected_as_a_fleet_is_the_one_run_projection() -> None:
    rates, cfg = load_rates(None), _config()
    alone = project(cfg, rates, learner_gpus=8, rollout_gpus=4)
    fleet = project_runs([("only", cfg)], rates, learner_gpus=[8], rollout_gpus=4)
    assert fleet.runs == [alone]
    assert fleet.capacity >= alone.fleet.slots_per_server  # the gate never held a group back


def test_shares_one_to_three_split_a_saturated_fleet_one_to_three() -> None:
    """Two identical runs, fast learners, one rollout GPU: the fleet is the bottleneck, the gate decides."""
    p = project_runs([("a", _config(1)), ("b", _config(3))], load_rates(None), learner_gpus=[64, 64], rollout_gpus=1)
    r = p.result
    assert r.decode_used > 0.95 and all(s.learner_idle > 0.5 for s in r.runs)  # rollout-bound, as meant
    assert r.token_share[0] == pytest.approx(0.25, abs=0.05)
    a, b = (s.samples_per_s for s in r.runs)
    assert a / (a + b) == pytest.approx(0.25, abs=0.05)


def test_a_learner_bound_run_leaves_its_share_to_the_other() -> None:
    """Equal shares; run a's one learner GPU cannot take a half of the fleet's tokens, so b gets the rest."""
    rates = load_rates(None)
    contended = project_runs([("a", _config()), ("b", _config())], rates, learner_gpus=[64, 64], rollout_gpus=1)
    p = project_runs([("a", _config()), ("b", _config())], rates, learner_gpus=[1, 64], rollout_gpus=1)
    a, b = p.result.runs
    assert a.learner_idle < 0.05  # a is learner-bound
    assert p.result.token_share[1] > 0.6 and p.result.decode_used > 0.9  # b takes what a leaves: none is wasted
    assert b.samples_per_s > 1.3 * contended.result.runs[1].samples_per_s


def test_cli_with_two_configs_prints_a_row_per_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    paths = []
    for name, share in (("math", 1), ("code", 3)):
        cfg = {"rollout": {"n": 4, "max_tokens": 256, "share": share}, "learner": {"train_batch_size": 16}}
        paths += ["--config", str(tmp_path / f"{name}.yaml")]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "runs.json"
    assert main(["plan", *paths, "--learner-gpus", "8,16", "--rollout-gpus", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 runs on 2 rollout GPUs" in text and "| run | share | learner GPUs |" in text
    assert "| math | 1 | 8 |" in text and "| code | 3 | 16 |" in text
    got = json.loads(out.read_text())
    assert [r["name"] for r in got["runs"]] == ["math", "code"]
    assert sum(r["token_share"] for r in got["runs"]) == pytest.approx(1.0)
    assert got["fleet"]["capacity"] == 256 // 4  # the rates file's engine batch over n
    assert main(["plan", *paths, "--learner-gpus", "8,8,8", "--rollout-gpus", "2"]) == 2
    assert main(["plan", *paths, "--total-gpus", "24"]) == 2
    assert main(["plan", paths[1], "--learner-gpus", "8", "--rollout-gpus", "2", "--fleet-slots", "4"]) == 2


def test_a_runs_weight_update_holds_its_own_groups_only() -> None:
    """Run a spends most of its time loading weights: b's groups go on generating meanwhile, and faster, with
    the engine to themselves."""

    def fleet(sync_s: float) -> FleetSpec:
        return FleetSpec(train_batch_size=4, n=4, max_staleness=1, sync_every=1, servers=1, slots_per_server=8,
                     server_tokens_per_s=2000.0, learner_step_s=0.01, learner_tokens_per_s=float("inf"),
                     sync_s=sync_s, lengths=Lengths(mean=50, cv=0.5))  # fmt: skip

    def b_rate(a_sync_s: float) -> float:
        runs = [SharedRun(fleet(a_sync_s), steps=30, warmup=3), SharedRun(fleet(0.01), steps=30, warmup=3)]
        return simulate_runs(runs, capacity=8).runs[1].samples_per_s

    assert b_rate(2.0) > 1.3 * b_rate(0.01)
