"""One run's faults on a shared rollout fleet stay that run's (issue 36 item 4), real processes, one Redis.

Run A trains with a real learner (``tether learner``) on a fleet (``tether rollout --runs A,B``) that also
serves run B; the test itself is B's learner — it publishes B's config, feeds B's prompts stream and sends
B's slot its weight updates — so B's fault is exactly the one injected. (A learner killed mid-run is
``test_fleet_runs.test_a_killed_learner_stalls_no_other_run``.) The fleet's output is read as it comes: a
fleet blocked on a full pipe would stall every run and pass for the fault under test.

- Bad input in B: undecodable prompt records, a prompt too long for the model, an empty prompt and prompts
  whose reward fails (B's reward is ``exact_match`` and they carry no answer). A trains to its last step on
  its own versions with no dead letter; B's bad items are dead-lettered and counted under B's keys only,
  each with its reason; B's good prompts, fed after the bad ones, still become groups in B's stream; the
  fleet drains on SIGTERM and exits 0.
- Bad input in B on a base A shares (LoRA runs of one model on one engine): prompts whose token ids are
  outside the vocabulary, arriving all along A's run. They are B's to dead-letter; none of A's samples —
  batched with B's rows on the shared engine — may end aborted because of them.
- A failed weight update in B: B's slot is sent an update whose snapshot it cannot load (a tensor of the
  wrong shape), and B's published version points at a newer snapshot that is not a snapshot at all, so
  each catch-up fails too. The commit is refused (FAILED_PRECONDITION) and B's slot stays on version 0
  and keeps serving B's prompts; A trains to its last step with its own updates landing on its slot
  (its registry entry and its data move past version 0); the fleet stays up and exits 0 on SIGTERM; the
  fleet's log names B's failures with B's run id.
- A weight update of B left hanging — prepared, never committed nor aborted (B's learner went away
  mid-update) — stalls no other run: B's engine is paused until the receiver's watchdog gives up (minutes),
  and A, on a fleet that runs one generation at a time, must still finish its steps meanwhile.

Each of the last three failed before its fix: the prompt worker took pre-tokenized prompts without the
vocabulary check the Generate RPC makes (a failed prefill aborts every row of the batch, other runs' rows on
a shared engine included); a slot's log lines carried no run id; a paused slot's frozen generations kept
holding the fleet's share-gate turns.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
import yaml
from safetensors.torch import save_file

from buffer import PromptQueue, RedisKeys, ServerRegistry
from buffer.dead_letter import ROLLOUT_DEAD_LETTER
from buffer.registry import publish_version
from buffer.run_config import publish_run_config
from tests.integration.test_fleet_runs import _config, _events, _fleet, _learner, _prompts
from tether.client import RolloutClient
from tether.config import load_config
from tether.metrics import read_metrics
from tether.tasks import demo_rows
from tether.v1 import control_pb2, trajectory_pb2
from weight_sync.snapshot import INDEX_FILE, VERSION_FILE, snapshot_dir

pytestmark = pytest.mark.slow
STEPS = 3
GROUP = 4  # learner.train_batch_size of write_config: groups a step trains on


def _publish(client: redis.Redis, path: Path) -> None:
    """Publish the run's config as its learner would at start (the test is that run's learner)."""
    cfg = load_config(path, [])
    publish_run_config(client, RedisKeys(cfg.run.run_id or ""), cfg.model_dump(mode="json"))


def _feed(client: redis.Redis, run: str, prompts: list[trajectory_pb2.Prompt]) -> None:
    fed = PromptQueue(client, RedisKeys(run)).feed(iter(prompts), version=0, prompts_per_version=10_000,
                                                   max_staleness=0)  # fmt: skip
    assert fed == len(prompts)


def _slot(client: redis.Redis, run: str, fleet: subprocess.Popen, timeout_s: float = 180) -> str:
    """The address of the run's slot once it is in the run's registry."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and fleet.poll() is None:
        live = ServerRegistry(client, RedisKeys(run)).live()
        if live:
            return live[0].address
        time.sleep(0.3)
    raise AssertionError(f"run {run!r} got no live slot (fleet exit code {fleet.poll()})")


def _trained(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(metrics) if r.get("reward/mean") is not None] if metrics.exists() else []


def _counters(client: redis.Redis, run: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(RedisKeys(run).counters).items()}


class _Output:
    """A process's output, read as it comes: a fleet whose log fills the pipe while nobody reads it (64 KiB:
    a few tracebacks) blocks on its next line, every slot with it, which would read as one run stalling all."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout or []), daemon=True)
        self.thread.start()

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


def _start_fleet(cfg: Path, redis_url: str, runs: list[str]) -> tuple[subprocess.Popen, _Output]:
    fleet = _fleet(cfg, redis_url, runs)
    return fleet, _Output(fleet)


def _stop(fleet: subprocess.Popen, output: _Output, *learners: subprocess.Popen) -> str:
    """SIGTERM the fleet and return its output; anything still running is killed."""
    try:
        if fleet.poll() is None:
            fleet.send_signal(signal.SIGTERM)
        fleet.wait(timeout=120)
    finally:
        for proc in (fleet, *learners):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return output.text()


def _assert_trained_alone(tmp_path: Path, run: str, client: redis.Redis) -> dict:
    """The run trained steps 1..STEPS on its own later versions, acknowledged every group and has no dead
    letter anywhere (its stats, its counters, its stream); its last metrics row."""
    run_dir = tmp_path / "runs" / run
    rows = _trained(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), (run, rows[-1:])
    assert rows[0]["data/version_max"] == 0 and rows[-1]["data/version_max"] >= 1, (run, rows[-1])
    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    assert stats["buffer/acknowledged"] == STEPS * GROUP and stats["buffer/dead_letter"] == 0, (run, stats)
    counters = _counters(client, run)
    dead = {k: v for k, v in counters.items() if "dead_letter" in k and v}
    assert dead == {} and client.xlen(RedisKeys(run).dead_letter) == 0, (run, counters)
    return rows[-1]


def test_bad_input_of_one_run_is_dead_lettered_under_its_keys_only(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    a, b = "badin-a", "badin-b"
    configs = {a: _config(tmp_path, tiny_model_dir, a, steps=STEPS),
               b: _config(tmp_path, tiny_model_dir, b, reward={"type": "exact_match"})}  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    _publish(client, configs[b])
    keys_b = RedisKeys(b)
    PromptQueue(client, keys_b)  # the stream and its consumer group, before the raw records below
    # B's bad input first, its good prompts last: what comes after the bad items is still served.
    client.xadd(keys_b.prompts, {b"p": b"\xff\xff\xff\xff"})  # not a Prompt protobuf
    client.xadd(keys_b.prompts, {b"not-p": b"1"})  # no prompt field at all
    bad = [
        trajectory_pb2.Prompt(prompt_id="too-long", text="x" * 3000, reward_context={"answer": "x"}),
        trajectory_pb2.Prompt(prompt_id="empty", text="", reward_context={"answer": "x"}),
        *(trajectory_pb2.Prompt(prompt_id=f"no-answer-{i}", text=f"say {i}") for i in range(2)),
    ]
    good = [trajectory_pb2.Prompt(prompt_id=f"good-{i}", text=f"say {i}", reward_context={"answer": "x"})
            for i in range(3)]  # fmt: skip
    _feed(client, b, bad + good)

    fleet, output = _start_fleet(configs[a], redis_url, [a, b])
    learner = _learner(configs[a], redis_url)
    out_a = fleet_out = ""
    try:
        out_a, _ = learner.communicate(timeout=480)
        deadline, counters = time.monotonic() + 120, {}
        while time.monotonic() < deadline and fleet.poll() is None:
            counters = _counters(client, b)
            if client.xlen(keys_b.trajectories) >= len(good) and counters.get(ROLLOUT_DEAD_LETTER, 0) >= 4:
                break
            time.sleep(0.3)
    finally:
        fleet_out = _stop(fleet, output, learner)
    assert learner.returncode == 0, out_a[-3000:] + fleet_out[-3000:]
    assert fleet.returncode == 0, fleet_out[-3000:]  # B's bad input failed no slot

    _assert_trained_alone(tmp_path, a, client)
    # B's bad items: dead-lettered under B's keys, each counted and with its reason; nothing else there.
    counters = _counters(client, b)
    assert counters.get("prompts_dead_letter") == 2 and counters.get(ROLLOUT_DEAD_LETTER) == 4, counters
    reasons = [e[1][b"reason"].decode() for e in client.xrange(keys_b.dead_letter)]
    assert len(reasons) == 6, reasons
    assert sum("undecodable prompt" in r for r in reasons) == 2, reasons
    assert sum("is longer than the limit" in r for r in reasons) == 1, reasons
    assert sum("empty after tokenization" in r for r in reasons) == 1, reasons
    assert sum("reward failed" in r and "'answer'" in r for r in reasons) == 2, reasons
    # Only B has a dead-letter stream in this Redis.
    streams = sorted(k.decode() for k in client.scan_iter("tether:*:dead_letter"))
    assert streams == [keys_b.dead_letter], streams
    # B's good prompts, fed after the bad ones, were served: one group each in B's stream.
    groups = client.xlen(keys_b.trajectories)
    assert groups == len(good), (groups, counters, fleet_out[-3000:])
    assert _events(fleet_out, "fleet_run_failed") == [], fleet_out[-3000:]
    client.close()


def _lora(path: Path) -> Path:
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_bad_input_of_one_run_aborts_nothing_of_a_run_sharing_its_base(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    a, b = "vocab-a", "vocab-b"
    # A's completions run long (64 tokens), so its rows are on the engine most of the time, and the fleet
    # runs four generations at once, so B's never wait for A's to end.
    configs = {run: _lora(_config(tmp_path, tiny_model_dir, run, steps=STEPS, max_tokens=64)) for run in (a, b)}
    fleet_cfg = _lora(_config(tmp_path, tiny_model_dir, "vocab-fleet", prompt_workers=4))
    client = redis.Redis.from_url(redis_url)
    _publish(client, configs[b])
    keys_b = RedisKeys(b)
    rows = iter(demo_rows(seed=3))

    def pair(i: int) -> list[trajectory_pb2.Prompt]:
        """A prompt of token ids no model has, and a good one."""
        bad, good = next(rows), next(rows)
        return [trajectory_pb2.Prompt(prompt_id=f"bad-{i}", token_ids=[10**6, 7], text=bad["prompt"],
                                      reward_context={"answer": bad["answer"]}),
                trajectory_pb2.Prompt(prompt_id=f"good-{i}", text=good["prompt"],
                                      reward_context={"answer": good["answer"]})]  # fmt: skip

    fleet, output = _start_fleet(fleet_cfg, redis_url, [a, b])
    learner = _learner(configs[a], redis_url)
    out_a = fleet_out = ""
    pairs = 0
    try:
        # B's bad prompts arrive all along A's run (twenty a second), so they meet A's rows on the engine.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and learner.poll() is None:
            if ServerRegistry(client, RedisKeys(a)).live():
                _feed(client, b, pair(pairs))
                pairs += 1
            time.sleep(0.05)
        out_a, _ = learner.communicate(timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and fleet.poll() is None:
            done = client.xlen(keys_b.trajectories) + _counters(client, b).get(ROLLOUT_DEAD_LETTER, 0)
            if done >= 2 * pairs:
                break
            time.sleep(0.3)
    finally:
        fleet_out = _stop(fleet, output, learner)
    assert learner.returncode == 0, out_a[-3000:] + fleet_out[-3000:]
    assert fleet.returncode == 0, fleet_out[-3000:]
    joined = _events(fleet_out, "fleet_run_joined")
    assert sorted(e["run"] for e in joined) == [a, b] and all(e["shared_base"] for e in joined), joined
    assert pairs >= 5, pairs

    # None of A's samples was cut off by B's input (the learner skips aborted samples and counts them; a step
    # left with none trains on nothing).
    rows = read_metrics(tmp_path / "runs" / a / "metrics.jsonl")
    aborted = {r["step"]: r["learner/skipped_aborted"] for r in rows if r.get("learner/skipped_aborted")}
    failed = _events(fleet_out, "batch_failed")
    assert aborted == {}, (aborted, len(failed), failed[:1])
    trained = _trained(tmp_path / "runs" / a)
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1)), trained[-1:]
    # B's bad prompts are dead-lettered under B's keys, each with its reason; its good ones became groups.
    counters = _counters(client, b)
    reasons = [e[1][b"reason"].decode() for e in client.xrange(keys_b.dead_letter)]
    assert counters.get(ROLLOUT_DEAD_LETTER) == pairs == client.xlen(keys_b.trajectories), (counters, reasons[:2])
    assert all("outside the vocabulary" in r for r in reasons), reasons[:2]
    assert client.xlen(RedisKeys(a).dead_letter) == 0
    client.close()


def _unloadable_snapshot(folder: Path, version: int) -> Path:
    """A complete-looking snapshot (VERSION marker, index) whose one tensor has the wrong shape: the load
    checks it and refuses before changing anything."""
    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    index = {"metadata": {"version": version}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    (folder / VERSION_FILE).write_text(f"{version}\n")
    return folder


def _plan(path: Path, version: int, update_id: str) -> control_pb2.WeightUpdatePlan:
    return control_pb2.WeightUpdatePlan(version=version, update_id=update_id,
                                        filesystem=control_pb2.FilesystemSource(path=str(path)))  # fmt: skip


def test_a_failed_weight_update_of_one_run_stalls_no_other(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    a, b = "wfail-a", "wfail-b"
    configs = {a: _config(tmp_path, tiny_model_dir, a, steps=STEPS), b: _config(tmp_path, tiny_model_dir, b)}
    client = redis.Redis.from_url(redis_url)
    _publish(client, configs[b])
    keys_b = RedisKeys(b)
    _feed(client, b, list(_prompts(4)))
    bad_update = _unloadable_snapshot(tmp_path / "bad-update", 1)
    # B's published version is 5 and its newest snapshot (where its slot catches up from) is not loadable.
    snapshots_b = tmp_path / "runs" / b / "snapshots"
    garbage = snapshot_dir(snapshots_b, 5)
    garbage.mkdir(parents=True)
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    (garbage / VERSION_FILE).write_text("5\n")

    fleet, output = _start_fleet(configs[a], redis_url, [a, b])
    learner = _learner(configs[a], redis_url)
    out_a = fleet_out = ""
    try:
        address = _slot(client, b, fleet)
        with RolloutClient(address, timeout_s=60) as c:
            ready = c.control.PrepareWeightUpdate(_plan(bad_update, 1, "b-1"), timeout=60)
            assert ready.ready and ready.current_version == 0, ready
            with pytest.raises(grpc.RpcError) as err:
                c.control.CommitWeightUpdate(control_pb2.CommitWeightUpdateRequest(update_id="b-1", version=1),
                                             timeout=60)  # fmt: skip
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        publish_version(client, keys_b, 5)  # each heartbeat of B's slot now tries (and fails) to catch up
        _feed(client, b, [trajectory_pb2.Prompt(prompt_id=f"after-{i}", text=p.text, reward_context=p.reward_context)
                          for i, p in enumerate(_prompts(4))])  # fmt: skip
        out_a, _ = learner.communicate(timeout=480)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and fleet.poll() is None and client.xlen(keys_b.trajectories) < 8:
            time.sleep(0.3)
        held = {run: [s.policy_version for s in ServerRegistry(client, RedisKeys(run)).live()] for run in (a, b)}
    finally:
        fleet_out = _stop(fleet, output, learner)
    assert learner.returncode == 0, out_a[-3000:] + fleet_out[-3000:]
    assert fleet.returncode == 0, fleet_out[-3000:]  # B's failed updates failed no slot, and the fleet stayed up

    last = _assert_trained_alone(tmp_path, a, client)
    # A's updates landed on its slot: its registry entry serves a version past 0, which its data came from.
    assert len(held[a]) == 1 and held[a][0] >= 1 and last["data/version_max"] >= 1, (held, last)
    # B: still version 0, still served (its prompts fed after the failures became groups).
    assert held[b] == [0], held
    assert client.xlen(keys_b.trajectories) == 8, fleet_out[-3000:]
    # B's failures are in the fleet's log, with B's run id (the fleet serves more than one run).
    dropped = _events(fleet_out, "weight_update_dropped")
    assert [e["version"] for e in dropped] == [1], fleet_out[-3000:]
    caught = _events(fleet_out, "catch_up_failed")
    assert caught, fleet_out[-3000:]
    assert {e.get("run") for e in dropped + caught} == {b}, (dropped, caught[:2])
    client.close()


def test_a_hanging_weight_update_of_one_run_stalls_no_other(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    # One generation at a time on the fleet (its gate's capacity 1), and B always has prompts waiting: B's
    # generations hold the fleet's one turn about half the time. B's update is prepared (its engine pauses,
    # in-flight requests kept) and never committed: the receiver resumes only after its watchdog
    # (prepare + transfer + commit timeouts: 210 s by default). A must go on meanwhile.
    a, b = "hang-a", "hang-b"
    steps = STEPS + 1
    configs = {a: _config(tmp_path, tiny_model_dir, a, steps=steps), b: _config(tmp_path, tiny_model_dir, b)}
    fleet_cfg = _config(tmp_path, tiny_model_dir, "hang-fleet", prompt_workers=1)
    client = redis.Redis.from_url(redis_url)
    _publish(client, configs[b])
    _feed(client, b, list(_prompts(400)))
    update = _unloadable_snapshot(tmp_path / "never-loaded", 1)  # never read: the update is never committed

    fleet, output = _start_fleet(fleet_cfg, redis_url, [a, b])
    learner = _learner(configs[a], redis_url)
    out_a = fleet_out = ""
    hung_at = finished_at = 0.0
    try:
        address = _slot(client, b, fleet)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and learner.poll() is None and not _trained(tmp_path / "runs" / a):
            time.sleep(0.2)  # A's first step is trained: both runs are generating
        assert client.xlen(RedisKeys(b).trajectories) >= 1
        with RolloutClient(address, timeout_s=60) as c:
            assert c.control.PrepareWeightUpdate(_plan(update, 1, "b-hangs"), timeout=60).ready
            hung_at = time.monotonic()
            try:
                out_a, _ = learner.communicate(timeout=60)  # A's remaining steps take seconds, not minutes
                finished_at = time.monotonic()
            except subprocess.TimeoutExpired:
                pass
            c.control.AbortWeightUpdate(control_pb2.AbortWeightUpdateRequest(update_id="b-hangs"), timeout=60)
    finally:
        fleet_out = _stop(fleet, output, learner)
    rows = _trained(tmp_path / "runs" / a)
    assert finished_at, (f"A was stalled by B's hanging update: steps {[r['step'] for r in rows]} of {steps} "
                         f"after 60 s", fleet_out[-3000:])  # fmt: skip
    assert learner.returncode == 0, out_a[-3000:] + fleet_out[-3000:]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows[-1:]
    assert fleet.returncode == 0, fleet_out[-3000:]
    assert finished_at - hung_at < 60
    client.close()
