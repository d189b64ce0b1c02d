"""One rollout fleet serving several runs (issue 36): ``tether rollout --runs a,b``, real processes, one Redis.

- Two learners, each its own run (``tether learner``), and one fleet process serving both: each run trains to
  its last step on groups its own slot generated, with its own weight versions (the last step trained on a
  later version than the first), acknowledges every group, and the fleet exits 0 by itself once both
  runs have ended. A third run whose config cannot be served (its model is missing) fails its slot alone:
  the other two train as if it were not there, and the fleet says which run failed.
- A run's learner killed after its first step stalls no other run on the fleet.
- Two fleets serving the same two runs: one SIGKILLed mid-run, both runs finish on the other.
- ``--runs '*'``: a fleet started before any run joins the runs whose learners ask as they come, and not a
  run that has already ended.
- Shares: two runs with ``rollout.share`` 1 and 3, prompts waiting in both, and one generation at a time
  (``rollout.prompt_workers: 1`` in the fleet's config): the generated tokens split about 1:3, and
  ``tether status --fleets`` shows the fleet with both runs and their shares.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from buffer import PromptQueue, RedisKeys, ServerRegistry, TrajectoryReader
from buffer.health import publish_run_end
from buffer.run_config import publish_run_config
from tests.integration.test_up import REPO, write_config
from tether.config import load_config
from tether.metrics import read_metrics
from tether.tasks import demo_rows
from tether.v1 import trajectory_pb2

pytestmark = pytest.mark.slow
STEPS = 4


def _config(tmp_path: Path, model: Path, run_id: str, *, steps: int = STEPS, **rollout) -> Path:
    folder = tmp_path / run_id
    folder.mkdir()
    path = write_config(folder, model, run_id=run_id, steps=steps)
    cfg = yaml.safe_load(path.read_text())
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    cfg["rollout"].update(rollout)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fleet(cfg: Path, redis_url: str, runs: list[str], *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tether", "rollout", "--config", str(cfg), "--buffer.redis_url", redis_url,
           "--runs", ",".join(runs), "--run.log_format", "json", *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _learner(cfg: Path, redis_url: str, *, new_session: bool = False) -> subprocess.Popen:
    """``tether learner`` (it becomes torchrun, whose ranks are its children: ``new_session`` lets a test kill
    them all)."""
    cmd = [sys.executable, "-m", "tether", "learner", "--config", str(cfg), "--buffer.redis_url", redis_url]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)  # fmt: skip


def _learners_then_fleet(learners: dict[str, subprocess.Popen], fleet: subprocess.Popen) -> str:
    """Wait for every learner, then for the fleet to exit by itself; each learner must exit 0. The fleet's
    output (all of it, also when something hangs and is killed)."""
    outs: dict[str, str] = {}
    fleet_out = None
    try:
        outs = {run: proc.communicate(timeout=480)[0] for run, proc in learners.items()}
        fleet_out, _ = fleet.communicate(timeout=120)
    finally:
        for proc in (fleet, *learners.values()):
            if proc.poll() is None:
                proc.kill()
        if fleet_out is None:
            fleet_out = fleet.communicate()[0]
    for run, proc in learners.items():
        assert proc.returncode == 0, (run, outs.get(run, "")[-3000:], fleet_out[-3000:])
    return fleet_out


def _events(out: str, name: str) -> list[dict]:
    found = []
    for line in out.splitlines():
        if f'"{name}"' in line and line.lstrip().startswith("{"):
            found.append(json.loads(line))
    return found


def test_one_fleet_serves_two_runs_and_a_failing_run_stops_neither(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    runs = ["fleet-a", "fleet-b"]
    configs = {run: _config(tmp_path, tiny_model_dir, run) for run in runs}
    client = redis.Redis.from_url(redis_url)
    # A run whose learner published a config this fleet cannot serve: its model is not there.
    bad = load_config(configs["fleet-a"], ["--run.run_id", "fleet-bad"]).model_dump(mode="json")
    bad["model"]["path"] = str(tmp_path / "no-such-model")
    publish_run_config(client, RedisKeys("fleet-bad"), bad)
    fleet = _fleet(configs["fleet-a"], redis_url, [*runs, "fleet-bad"], "--exit-when-run-ends")
    learners = {run: _learner(configs[run], redis_url) for run in runs}
    fleet_out = _learners_then_fleet(learners, fleet)  # no signal: both runs end, their slots exit
    assert fleet.returncode == 1, fleet_out[-3000:]  # a slot failed, and the fleet says so in its code
    failed = _events(fleet_out, "fleet_run_failed") + _events(fleet_out, "fleet_run_refused")
    assert [e["run"] for e in failed] == ["fleet-bad"], fleet_out[-3000:]
    joined = {e["run"]: e["server_id"] for e in _events(fleet_out, "fleet_run_joined")}
    assert set(runs) <= set(joined) and len({joined[r] for r in runs}) == 2  # one slot (server) a run

    for run in runs:
        run_dir = tmp_path / "runs" / run
        rows = _steps(run_dir)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), run
        # the run's own weight updates reached its slot: later steps trained on a later version of this run
        assert rows[0]["data/version_max"] == 0 and rows[-1]["data/version_max"] >= 1, (run, rows[-1])
        stats = json.loads((run_dir / "buffer_stats.json").read_text())
        assert stats["buffer/acknowledged"] == STEPS * 4 and stats["buffer/dead_letter"] == 0, (run, stats)
        groups = _groups(run_dir)
        assert groups and {g["server"] for g in groups} == {joined[run]}, (run, groups[:2])
    client.close()


def _prompts(n: int):
    for i, row in zip(range(n), demo_rows(seed=2), strict=False):
        yield trajectory_pb2.Prompt(
            prompt_id=f"p{i}", dataset_index=i, text=row["prompt"], reward_context={"answer": row["answer"]}
        )


def _read_tokens(reader: TrajectoryReader, counts: list[int]) -> None:
    """Read what a run's stream holds now into ``counts`` = [groups, completion tokens]."""
    for b in reader.read(100, current_version=0, max_staleness=100, block_ms=0):
        counts[0] += 1
        counts[1] += sum(t.num_completion_tokens for t in b.group.trajectories)


def test_shares_split_the_generated_tokens(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    shares = {"share-a": 1.0, "share-b": 3.0}
    client = redis.Redis.from_url(redis_url)
    for run, share in shares.items():
        path = _config(tmp_path, tiny_model_dir, run, share=share, prompt_workers=2, max_tokens=16)
        cfg = load_config(path, ["--buffer.max_trajectory_groups", "1000"])
        publish_run_config(client, RedisKeys(run), cfg.model_dump(mode="json"))
        fed = PromptQueue(client, RedisKeys(run)).feed(_prompts(200), version=0, prompts_per_version=200,
                                                       max_staleness=0)  # fmt: skip
        assert fed == 200
    fleet_cfg = _config(tmp_path, tiny_model_dir, "fleet-itself", prompt_workers=1)
    fleet = _fleet(fleet_cfg, redis_url, list(shares))
    buffer = load_config(None, []).buffer
    readers = {run: TrajectoryReader(client, RedisKeys(run), buffer, consumer="test") for run in shares}
    counts = {run: [0, 0] for run in shares}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and fleet.poll() is None and sum(g for g, _ in counts.values()) < 40:
            for run, reader in readers.items():
                _read_tokens(reader, counts[run])
            time.sleep(0.2)
        status = subprocess.run([sys.executable, "-m", "tether", "status", "--fleets", "--buffer.redis_url", redis_url],
                                cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
        fleet.send_signal(signal.SIGTERM)
        out, _ = fleet.communicate(timeout=120)
    finally:
        if fleet.poll() is None:
            fleet.kill()
    assert sum(g for g, _ in counts.values()) >= 40, out[-3000:]
    # `tether status --fleets` while it served: the fleet, and each run with its share
    assert status.returncode == 0 and "fleet " in status.stdout, status.stdout + status.stderr
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines() if line.strip().startswith("share-")}
    assert {run: float(row[1]) for run, row in rows.items()} == shares, status.stdout
    # The split is measured in tokens over the whole window; both runs had prompts waiting throughout.
    a, b = counts["share-a"][1], counts["share-b"][1]
    assert 0.65 <= b / (a + b) <= 0.85, (counts, out[-2000:])
    stopped = _events(out, "fleet_stopped")
    assert stopped and set(stopped[0]["shares"]) == set(shares), out[-2000:]
    client.close()


def _as_run(published: dict, run_id: str) -> dict:
    return {**published, "run": {**published["run"], "run_id": run_id}}


def test_a_fleet_of_every_run_joins_runs_as_they_ask(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    # ``--runs '*'``: the fleet starts first; runs whose learners publish a config later are joined as they
    # come, and a run whose end is already published is not.
    client = redis.Redis.from_url(redis_url)
    config = _config(tmp_path, tiny_model_dir, "every-a")
    published = load_config(config, []).model_dump(mode="json")
    publish_run_config(
        client, RedisKeys("every-done"), {**published, "run": {**published["run"], "run_id": "every-done"}}
    )
    publish_run_end(client, RedisKeys("every-done"), step=1, version=1)
    fleet = _fleet(config, redis_url, ["*"])
    try:
        for run in ("every-a", "every-b"):
            time.sleep(1.0)  # after the fleet's first look: these runs ask while it runs
            publish_run_config(client, RedisKeys(run), _as_run(published, run))
        deadline, live = time.monotonic() + 120, {}
        while time.monotonic() < deadline and fleet.poll() is None:
            live = {run: ServerRegistry(client, RedisKeys(run)).live() for run in ("every-a", "every-b")}
            if all(live.values()):
                break
            time.sleep(0.5)
        fleet.send_signal(signal.SIGTERM)
        out, _ = fleet.communicate(timeout=120)
    finally:
        if fleet.poll() is None:
            fleet.kill()
    assert all(live.values()), (live, out[-3000:])
    assert fleet.returncode == 0, out[-3000:]
    assert sorted(e["run"] for e in _events(out, "fleet_run_joined")) == ["every-a", "every-b"], out[-3000:]
    client.close()


def test_each_run_reaches_its_own_slot_only(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    # A fleet with a token: each run's slot takes that run's own token (`tether run-token`), not another
    # run's, and not the fleet's secret itself.
    import grpc

    from tether.auth import run_token
    from tether.client import RolloutClient

    client = redis.Redis.from_url(redis_url)
    config = _config(tmp_path, tiny_model_dir, "token-a")
    published = load_config(config, []).model_dump(mode="json")
    for run in ("token-a", "token-b"):
        publish_run_config(client, RedisKeys(run), _as_run(published, run))
    secret = "fleet-secret"
    env = {**os.environ, "TETHER_AUTH_TOKEN": secret}
    cmd = [sys.executable, "-m", "tether", "rollout", "--config", str(config), "--buffer.redis_url", redis_url,
           "--runs", "token-a,token-b"]  # fmt: skip
    fleet = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, live = time.monotonic() + 120, {}
        while (
            time.monotonic() < deadline
            and fleet.poll() is None
            and not all(live.get(r) for r in ("token-a", "token-b"))
        ):
            live = {run: ServerRegistry(client, RedisKeys(run)).live() for run in ("token-a", "token-b")}
            time.sleep(0.5)
        assert all(live.values()), live
        address = live["token-a"][0].address
        with RolloutClient(address, token=run_token(secret, "token-a"), timeout_s=60) as c:
            assert len(c.generate(text="go", n=1, max_tokens=4).samples) == 1  # its own run's token: served
        for wrong in (run_token(secret, "token-b"), secret):
            with RolloutClient(address, token=wrong, timeout_s=60) as c, pytest.raises(grpc.RpcError) as err:
                c.generate(text="go", n=1, max_tokens=4)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        printed = subprocess.run([sys.executable, "-m", "tether", "run-token", "--run.run_id", "token-a"], cwd=REPO,
                                 env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert printed.stdout.strip() == run_token(secret, "token-a"), printed.stderr
    finally:
        fleet.send_signal(signal.SIGTERM)
        fleet.communicate(timeout=120)
        client.close()


def test_a_killed_learner_stalls_no_other_run(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    # Run A's learner is SIGKILLed after its first step; run B, on the same fleet, trains to its last step,
    # and the fleet, its slot of A idle, drains on SIGTERM and exits 0.
    configs = {"killed-a": _config(tmp_path, tiny_model_dir, "killed-a", steps=1000),  # killed long before its end
               "alive-b": _config(tmp_path, tiny_model_dir, "alive-b")}  # fmt: skip
    fleet = _fleet(configs["killed-a"], redis_url, list(configs))
    learners = {run: _learner(cfg, redis_url, new_session=True) for run, cfg in configs.items()}
    killed_dir = tmp_path / "runs" / "killed-a"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and learners["killed-a"].poll() is None:
            if _steps(killed_dir):
                break
            time.sleep(0.2)
        os.killpg(learners["killed-a"].pid, signal.SIGKILL)
        out_b, _ = learners["alive-b"].communicate(timeout=480)
        fleet.send_signal(signal.SIGTERM)
        fleet_out, _ = fleet.communicate(timeout=120)
    finally:
        for proc in learners.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if fleet.poll() is None:
            fleet.kill()
    assert learners["alive-b"].returncode == 0, out_b[-3000:] + fleet_out[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "runs" / "alive-b")] == list(range(1, STEPS + 1))
    assert fleet.returncode == 0, fleet_out[-3000:]
    assert 1 <= len(_steps(killed_dir)) < 1000  # run A really died mid-run


def test_two_fleets_serve_the_same_runs_and_either_can_carry_them(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    # Two fleet processes serve the same two runs: each run has a slot on each fleet (two servers in its
    # registry, both taking its weight updates). Two steps after both fleets' slots serve both runs, fleet one
    # is SIGKILLed: the runs train to their last step on fleet two (the prompts fleet one held are claimed
    # after buffer.claim_idle_ms), every group acknowledged once, and fleet two exits 0 by itself.
    from buffer.fleets import live_fleets

    steps, runs = 40, ["pair-a", "pair-b"]
    configs = {run: _config(tmp_path, tiny_model_dir, run, steps=steps) for run in runs}
    for path in configs.values():
        cfg = yaml.safe_load(path.read_text())
        cfg["buffer"] = {"claim_idle_ms": 3000}
        path.write_text(yaml.safe_dump(cfg))
    client = redis.Redis.from_url(redis_url)
    one = _fleet(configs["pair-a"], redis_url, runs, "--rollout.server_id", "fleet-one")
    two = _fleet(configs["pair-a"], redis_url, runs, "--rollout.server_id", "fleet-two", "--exit-when-run-ends")
    learners = {run: _learner(configs[run], redis_url) for run in runs}
    slots: dict[str, dict[str, str]] = {}  # fleet -> run -> its slot's server id
    registered: dict[str, set[str]] = {run: set() for run in runs}  # run -> the servers seen in its registry
    steps_then: dict[str, int] | None = None  # each run's steps when both fleets served both runs
    trained: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and all(p.poll() is None for p in (one, *learners.values())):
            trained = {run: len(_steps(tmp_path / "runs" / run)) for run in runs}
            if steps_then is None:
                slots = {f.fleet_id: {r: v["server_id"] for r, v in f.runs.items()} for f in live_fleets(client)}
                for run in runs:
                    registered[run] |= {i.server_id for i in ServerRegistry(client, RedisKeys(run)).live()}
                if all(slots.get(f, {}).get(r) in registered[r] for f in ("fleet-one", "fleet-two") for r in runs):
                    steps_then = trained
            elif all(trained[r] >= steps_then[r] + 2 for r in runs):
                break
            time.sleep(0.1)
        one.kill()
        one_out = one.communicate(timeout=60)[0]
        two_out = _learners_then_fleet(learners, two)
    finally:
        for proc in (one, two, *learners.values()):
            if proc.poll() is None:
                proc.kill()
    assert steps_then is not None and all(trained[r] < steps for r in runs), (steps_then, trained, slots)
    assert two.returncode == 0, two_out[-3000:]
    loaded = {e.get("run") for e in _events(one_out, "weight_update_loaded")}
    assert set(runs) <= loaded, one_out[-3000:]  # fleet one served both runs' weight updates before it died
    for run in runs:
        run_dir = tmp_path / "runs" / run
        assert [r["step"] for r in _steps(run_dir)] == list(range(1, steps + 1)), run
        stats = json.loads((run_dir / "buffer_stats.json").read_text())
        assert stats["buffer/acknowledged"] == steps * 4 and stats["buffer/dead_letter"] == 0, (run, stats)
        groups = _groups(run_dir)
        assert {g["server"] for g in groups} <= {slots["fleet-one"][run], slots["fleet-two"][run]}, run
        assert {g["server"] for g in groups if g["step"] == steps} == {slots["fleet-two"][run]}, run
    client.close()


def _steps(run_dir: Path) -> list[dict]:
    """The run's trained steps so far (metrics.jsonl rows with a reward)."""
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("reward/mean") is not None] if path.exists() else []


def _groups(run_dir: Path) -> list[dict]:
    """The groups the learner trained, in order (groups.jsonl)."""
    path = run_dir / "groups.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


VLLM_FLEET = "{type: vllm, enforce_eager: true, cpu_kvcache_space_gb: 1, max_num_seqs: 16, max_lora_rank: 8}"


@pytest.mark.parametrize(
    "engine", ["transformers", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(900)])]
)
def test_lora_runs_of_one_base_share_one_engine(
    engine: str, tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    # Two runs fine-tuning LoRA adapters of the same base: the fleet loads the base once, each run's rows
    # generate with its own adapter (replaced by its own updates), and both train to their last step.
    # vLLM: its multi-LoRA serving (one LoRARequest per adapter version; engines/vllm_adapters.py).
    if engine == "vllm":
        pytest.importorskip("vllm")
    runs = ("lora-a", "lora-b")
    configs = {}
    for run in runs:
        path = _config(tmp_path, tiny_model_dir, run)
        cfg = yaml.safe_load(path.read_text())
        cfg["model"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
        path.write_text(yaml.safe_dump(cfg))
        configs[run] = path
    extra = ["--rollout.engine", VLLM_FLEET, "--model.max_model_len", "512"] if engine == "vllm" else []
    fleet = _fleet(configs["lora-a"], redis_url, list(runs), "--exit-when-run-ends", *extra)
    learners = {run: _learner(cfg, redis_url) for run, cfg in configs.items()}
    fleet_out = _learners_then_fleet(learners, fleet)
    assert fleet.returncode == 0, fleet_out[-3000:]
    joined = _events(fleet_out, "fleet_run_joined")
    assert sorted(e["run"] for e in joined) == list(runs) and all(e["shared_base"] for e in joined), joined
    assert len(_events(fleet_out, "engine_started")) == 1, fleet_out[-3000:]  # the base, loaded once
    for run in runs:
        rows = _steps(tmp_path / "runs" / run)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), run
        assert rows[-1]["data/version_max"] >= 1, (run, rows[-1])  # tokens of the run's own later adapter
