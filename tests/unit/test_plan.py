"""The planner's simulator against closed forms, its run reader on a hand-made run folder, its rates files,
its Redis figures and its command line. The calibration against real runs is
``tests/integration/test_plan_calibration.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import simpy
import yaml

from buffer import BufferedGroup
from learner.group_trace import GroupTrace
from tether.commands.cli import main
from tether.commands.plan.calibrate import _busy_seconds, read_run
from tether.commands.plan.fleet import FleetSpec, Lengths
from tether.commands.plan.project import project
from tether.commands.plan.rates import DEFAULT_RATES, Rates, fleet_for, group_bytes, load_rates, with_weight_flags
from tether.commands.plan.sim import Engine, simulate
from tether.config import ConfigError, load_config
from tether.trajectory import GroupData, TrajectoryData

RATES_DIR = DEFAULT_RATES.parent


def _fleet(**kw) -> FleetSpec:
    base = dict(
        train_batch_size=4, n=4, max_staleness=0, sync_every=1, servers=1, slots_per_server=4,
        server_tokens_per_s=1000.0, learner_step_s=0.1, learner_tokens_per_s=float("inf"), sync_s=0.02,
        lengths=Lengths(mean=10),
    )  # fmt: skip
    return FleetSpec(**{**base, **kw})


def test_engine_shares_its_rate_and_caps_each_group() -> None:
    env = simpy.Environment()
    engine = Engine(env, tokens_per_s=100.0)
    done: dict[str, float] = {}

    def job(name: str, tokens: float, cap: float, start: float):
        yield env.timeout(start)
        yield engine.submit(tokens, cap)
        done[name] = env.now

    env.process(job("a", 10, float("inf"), 0))
    env.process(job("b", 30, float("inf"), 0))
    env.process(job("c", 5, 10.0, 0.1))  # capped at 10 tokens/s: 0.5 s whatever the share
    env.run()
    # a and b share 100 tokens/s; from 0.1 s c takes 10 and they share 90 until a ends, then b has 90.
    a_end = 0.1 + (10 - 5) / 45
    b_left = 30 - 5 - 45 * (a_end - 0.1)
    b_end = a_end + b_left / 90 if a_end + b_left / 90 < 0.6 else None
    assert done["c"] == pytest.approx(0.6)
    assert done["a"] == pytest.approx(a_end)
    if b_end is None:  # c ended first: then b alone at 100
        b_after_c = 30 - 5 - 45 * (a_end - 0.1) - 90 * (0.6 - a_end)
        b_end = 0.6 + b_after_c / 100
    assert done["b"] == pytest.approx(b_end)
    assert engine.busy_s == pytest.approx(max(done.values()))


@pytest.mark.parametrize("seed", range(4))
def test_synchronous_throughput_is_the_closed_form(seed: int) -> None:
    """max_staleness 0, every group generated at once: a step is generate + train + sync, nothing overlaps."""
    rng = np.random.default_rng(seed)
    b, n, length = int(rng.integers(2, 9)), int(rng.integers(1, 9)), float(rng.integers(5, 200))
    rate, learn, sync, read = rng.uniform(500, 5000), rng.uniform(0.01, 1), rng.uniform(0, 0.5), rng.uniform(0, 0.05)
    f = _fleet(train_batch_size=b, n=n, slots_per_server=b, server_tokens_per_s=rate, learner_step_s=learn,
               sync_s=sync, read_s=read, lengths=Lengths(mean=length))  # fmt: skip
    r = simulate(f, steps=12, warmup=2)
    gen = b * n * length / rate
    step = gen + read + learn + sync
    assert r.samples_per_s == pytest.approx(b * n / step, rel=1e-6)
    assert r.learner_idle == pytest.approx((gen + read) / step, rel=1e-6)
    assert r.sync_share == pytest.approx(sync / step, rel=1e-6)
    assert r.staleness == {0: 10 * b}


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_a_fast_rollout_side_leaves_the_learner_busy_and_data_max_staleness_old(eta: int) -> None:
    f = _fleet(max_staleness=eta, server_tokens_per_s=1e9, slots_per_server=64, learner_step_s=0.2, sync_s=0.05)
    r = simulate(f, steps=20, warmup=eta + 2)
    assert r.samples_per_s == pytest.approx(f.train_batch_size * f.n / 0.25, rel=1e-3)
    assert r.learner_idle < 1e-3
    assert set(r.staleness) == {eta}  # admission lets rollout run exactly eta versions ahead, no further


@pytest.mark.parametrize("eta", [1, 2])
def test_long_tailed_groups_are_waited_for_not_dropped(eta: int) -> None:
    """With ``stale_wait`` the learner waits for the groups about to pass the bound (none is dropped, and the
    bound still holds); without it the long ones, the last to finish, are the ones dropped."""
    common = dict(max_staleness=eta, slots_per_server=16, server_tokens_per_s=2000.0, learner_step_s=0.05,
                  lengths=Lengths(mean=20, cv=2.0, max_tokens=256), seq_tokens_per_s=200.0)  # fmt: skip
    wait = simulate(_fleet(**common), steps=60, warmup=eta + 2)
    drop = simulate(_fleet(**common, stale_wait=False), steps=60, warmup=eta + 2)
    assert wait.dropped_stale == 0 and max(wait.staleness) <= eta
    assert drop.dropped_stale > 0 and max(drop.staleness) <= eta


def test_a_slow_rollout_side_sets_the_pace() -> None:
    f = _fleet(max_staleness=2, server_tokens_per_s=400.0, learner_step_s=0.001, sync_s=0.0, slots_per_server=12)
    r = simulate(f, steps=60, warmup=5)
    assert r.samples_per_s == pytest.approx(400.0 / 10, rel=0.03)  # tokens/s over tokens per sample
    assert r.rollout_busy == pytest.approx(1.0, abs=0.02)


def test_keep_and_drain_differ_as_the_protocol_says() -> None:
    """drain: each update first waits for the groups in flight; keep: an update takes its transfer time."""
    common = dict(max_staleness=1, slots_per_server=8, server_tokens_per_s=2000.0, sync_s=0.05,
                  lengths=Lengths(mean=50, cv=1.5, max_tokens=400))  # fmt: skip
    keep = simulate(_fleet(**common, inflight="keep"), steps=40, warmup=3)
    drain = simulate(_fleet(**common, inflight="drain"), steps=40, warmup=3)
    assert keep.sync_share / keep.steps_per_s == pytest.approx(0.05)  # seconds of sync per step (sync_every 1)
    assert drain.sync_share / drain.steps_per_s > 0.05 * 1.5


@pytest.mark.parametrize("seed", range(5))
def test_random_fleets_keep_the_staleness_bound_and_the_capacity_bounds(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    eta = int(rng.integers(0, 4))
    f = _fleet(
        train_batch_size=int(rng.integers(1, 9)), n=int(rng.integers(1, 5)), max_staleness=eta,
        sync_every=int(rng.integers(1, 3)), servers=int(rng.integers(1, 4)), slots_per_server=int(rng.integers(1, 6)),
        server_tokens_per_s=rng.uniform(100, 3000), learner_step_s=rng.uniform(0.01, 0.3), sync_s=rng.uniform(0, 0.1),
        lengths=Lengths(mean=rng.uniform(5, 100), cv=rng.uniform(0, 2), max_tokens=300),
        inflight=str(rng.choice(["keep", "drain"])),
    )  # fmt: skip
    r = simulate(f, steps=25, warmup=eta + 2, seed=seed)
    assert max(r.staleness) <= eta
    learner_bound = f.train_batch_size * f.n / f.learner_step_s
    rollout_bound = f.servers * f.server_tokens_per_s / 1  # ≥ 1 token per sample
    assert 0 < r.samples_per_s <= min(learner_bound, rollout_bound) * 1.001
    assert 0 <= r.learner_idle <= 1 and 0 <= r.rollout_busy <= 1.001
    assert r.max_buffer_groups <= (eta + 1) * f.prompts_per_version


def test_lengths_sample_from_groups_or_a_capped_lognormal() -> None:
    rng = np.random.default_rng(0)
    seen = {tuple(Lengths(groups=((1, 2), (3, 4))).sample(rng, 2)) for _ in range(50)}
    assert seen == {(1.0, 2.0), (3.0, 4.0)}
    x = np.concatenate([Lengths(mean=100, cv=0.8, max_tokens=150).sample(rng, 1000) for _ in range(5)])
    assert x.max() <= 150 and x.min() >= 1
    assert Lengths(mean=100, cv=0.5).sample(rng, 20000).mean() == pytest.approx(100, rel=0.03)
    with pytest.raises(ValueError, match="positive mean"):
        Lengths()


def test_fleet_rejects_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match="servers"):
        _fleet(servers=0)
    with pytest.raises(ValueError, match="inflight"):
        _fleet(inflight="wait")
    with pytest.raises(ValueError, match="server_tokens_per_s"):
        _fleet(server_tokens_per_s=0)


def test_busy_seconds_is_the_union_of_intervals() -> None:
    assert _busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert _busy_seconds([]) == 0.0


def _write_run(folder: Path, *, steps: int = 6) -> None:
    folder.mkdir(parents=True)
    cfg = {"learner": {"train_batch_size": 2}, "rollout": {"n": 2, "prompt_workers": 3, "num_servers": 1},
           "algorithm": {"max_staleness": 1}}  # fmt: skip
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows, groups, t = [], [], 100.0
    for step in range(1, steps + 1):
        # each step: the batch's groups generated in [t, t + 0.2) on one server, 40 tokens each → 400 tokens/s
        for g in range(2):
            groups.append({"step": step, "staleness": 1, "server": "rollout-0", "started": t + 0.1 * g,
                           "finished": t + 0.1 * g + 0.1, "lengths": [20, 20], "prompt": 5})  # fmt: skip
        wait = 0.25  # generation ends 0.2 s in; 0.05 s more is reading
        t += 1.0
        rows.append({"step": step, "time": t, "timing/step": 1.0, "timing/wait_data": wait,
                     "timing/weight_sync": 0.1, "learner/samples": 4.0})  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))


def test_read_run_takes_each_rate_from_its_own_side(tmp_path: Path) -> None:
    _write_run(tmp_path / "r")
    fleet, measured, rates = read_run(tmp_path / "r")
    assert rates == [pytest.approx(400.0)]
    assert (fleet.train_batch_size, fleet.n, fleet.max_staleness, fleet.slots_per_server) == (2, 2, 1, 3)
    assert fleet.read_s == pytest.approx(0.05, abs=1e-6)  # the wait generation does not explain
    assert list(fleet.learner_step_samples) == pytest.approx([0.65] * 5)
    assert fleet.sync_s == pytest.approx(0.1)
    assert fleet.prompt_tokens == 5
    assert measured.samples_per_s == pytest.approx(4.0)  # 5 steps × 4 samples over 5 s
    assert measured.learner_idle == pytest.approx(0.25)
    assert measured.staleness == {1: 10}


def test_read_run_says_what_is_missing(tmp_path: Path) -> None:
    _write_run(tmp_path / "r")
    (tmp_path / "r" / "groups.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"no groups\.jsonl"):
        read_run(tmp_path / "r")
    _write_run(tmp_path / "short", steps=2)
    with pytest.raises(ConfigError, match="at least"):
        read_run(tmp_path / "short")


def test_group_trace_writes_one_line_per_group(tmp_path: Path) -> None:
    def traj(n: int, start: float) -> TrajectoryData:
        return TrajectoryData(
            prompt_token_ids=np.arange(3, dtype=np.int32), completion_token_ids=np.arange(n, dtype=np.int32),
            behavior_logprobs=np.zeros(n, np.float32), policy_versions=np.zeros(n, np.int32),
            loss_mask=np.ones(n, np.uint8), server_id="rollout-1", started_at=start, finished_at=start + 1,
        )  # fmt: skip

    batch = [BufferedGroup("1-0", GroupData("g", [traj(4, 10.0), traj(6, 10.5)]), staleness=2)]
    trace = GroupTrace(tmp_path / "groups.jsonl")
    trace.write(batch, step=7)
    (row,) = [json.loads(x) for x in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert row == {"step": 7, "staleness": 2, "server": "rollout-1", "started": 10.0, "finished": 11.5,
                   "lengths": [4, 6], "prompt": 3}  # fmt: skip


@pytest.mark.parametrize("name", ["h100-7b.yaml", "h100-32b.yaml"])
def test_shipped_rates_files_load_and_name_their_sources(name: str) -> None:
    rates = load_rates(RATES_DIR / name)
    assert len(rates.sources) >= 5 and rates.setting


def test_rates_errors_name_the_key(tmp_path: Path) -> None:
    data = yaml.safe_load((RATES_DIR / "h100-7b.yaml").read_text())
    data["rollout"]["tokens_per_sec"] = data["rollout"].pop("tokens_per_s")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"rollout\.tokens_per_s"):
        load_rates(bad)


def _rates(cv: float = 0.3, **redis) -> Rates:
    data = yaml.safe_load((RATES_DIR / "h100-7b.yaml").read_text())
    data["redis"].update(redis)
    data["workload"].update({"completion_mean": 200, "completion_cv": cv, "prompt_tokens": 100})
    return Rates.model_validate(data)


def test_fleet_for_turns_rates_and_a_split_into_a_fleet() -> None:
    cfg = load_config(None, ["--rollout.n", "4", "--learner.train_batch_size", "16", "--rollout.max_tokens", "512"])
    rates = _rates()
    f = fleet_for(cfg, rates, learner_gpus=4, rollout_gpus=6)
    assert f.servers == 6 and f.slots_per_server == 6  # tether's default: ceil(16 prompts × 2 versions / 6 servers)
    assert fleet_for(cfg, rates, learner_gpus=4, rollout_gpus=1).slots_per_server == 32
    big = load_config(None, ["--rollout.n", "4", "--learner.train_batch_size", "512"])
    assert fleet_for(big, rates, learner_gpus=4, rollout_gpus=1).slots_per_server == rates.rollout.max_num_seqs // 4
    assert f.learner_tokens_per_s == pytest.approx(4 * rates.learner.tokens_per_s_per_gpu * 0.85)
    push = fleet_for(cfg, with_weight_flags(rates, fanout=0, delta_ratio=1.0), learner_gpus=4, rollout_gpus=6)
    assert push.sync_s == pytest.approx(rates.weight_sync.latency_s + 2 * rates.model_params / 40e9)
    assert f.sync_s == push.sync_s  # the default simulates today's push of full weights
    pull = fleet_for(cfg, with_weight_flags(rates, fanout=2), learner_gpus=4, rollout_gpus=6)
    assert pull.sync_s > push.sync_s  # deltas: the codec on one core outweighs what a 40 GB/s wire saves
    with pytest.raises(ConfigError, match="rollout-gpus"):
        fleet_for(cfg, load_rates(RATES_DIR / "h100-32b.yaml"), learner_gpus=4, rollout_gpus=1)


def test_group_bytes_is_the_payload_arithmetic() -> None:
    # bench/buffer.py's group (8 × 256 prompt + 1024 completion tokens) is 0.11 MB on the wire
    assert group_bytes(n=8, prompt_tokens=256, completion_tokens=1024) == pytest.approx(0.1147e6, rel=0.02)


def test_projection_flags_a_saturated_redis() -> None:
    cfg = load_config(None, ["--rollout.n", "4", "--learner.train_batch_size", "16", "--rollout.max_tokens", "512"])
    fine = project(cfg, _rates(mb_per_s=1e6), learner_gpus=8, rollout_gpus=8)
    over = project(cfg, _rates(cv=0, mb_per_s=0.001), learner_gpus=8, rollout_gpus=8)
    assert not fine.redis_saturated and over.redis_saturated
    expected = over.sim.groups_per_s * over.group_bytes / 1e6  # equal lengths finish in order: nothing dropped
    assert over.sim.dropped_stale == 0 and over.trajectory_mb_per_s == pytest.approx(expected)
    assert over.redis_memory_mb <= over.redis_bound_mb


def test_cli_projects_sweeps_and_refuses_half_a_question(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rates = tmp_path / "rates.yaml"
    rates.write_text(yaml.safe_dump(_rates().model_dump()))
    small = ["--rollout.n", "4", "--learner.train_batch_size", "8", "--rollout.max_tokens", "256"]
    assert main(["plan", "--rates", str(rates), "--learner-gpus", "8", "--rollout-gpus", "8",
                 "--json", str(tmp_path / "p.json"), *small]) == 0  # fmt: skip
    assert "samples/s" in capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text())["samples_per_s"] > 0
    out = tmp_path / "sweep"
    assert main(["plan", "--rates", str(rates), "--learner-gpus", "8", "--sweep", str(out), "--ratios", "0.5,1",
                 "--staleness", "0,1", *small]) == 0  # fmt: skip
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "sweep.md").read_text().splitlines()) == 2 + 4
    assert main(["plan", "--rates", str(rates), "--total-gpus", "24", *small]) == 0
    assert "best split of 24 GPUs" in capsys.readouterr().out
    assert main(["plan", "--learner-gpus", "8"]) == 2
    assert main(["plan", "--from-run", str(tmp_path), "--learner-gpus", "8"]) == 2
