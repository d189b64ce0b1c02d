"""``docker compose up`` for real: the CPU profile of ``deploy/docker-compose.yml`` built and run in podman.

Only ``make test-compose`` runs this (``make test`` ignores the folder). The images are built locally
(stack.py), then the stack comes up as a user brings it up — Redis with AOF, the example reward service,
the learner and two rollout replicas via the file's ``scale:`` (``ROLLOUT_CPU_REPLICAS=2``) — and must:
train with rising reward, show two live servers and advancing versions in ``tether status`` through
``compose exec``, survive a SIGKILLed replica that its restart policy brings back at the current policy
version, and, after ``down`` and ``up``, resume from the learner's checkpoint with books that balance over
both lifetimes. Teardown leaves nothing behind, also when a check fails. Each phase's time, steps/s and
the image sizes are printed for the closing note.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.compose.stack import (
    DEBIAN_IMAGE,
    PYTHON_IMAGE,
    REDIS_IMAGE,
    REPO,
    TETHER_IMAGE,
    Stack,
    build_images,
    image_size_mb,
    podman,
)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

RUN_ID = "compose-ci"
FIRST_STEPS = 60  # the first lifetime; the second continues to SECOND_STEPS from its checkpoint
SECOND_STEPS = 68
CHECKPOINT_EVERY = 20
STATUS = "tether status --config /etc/tether/cpu.yaml --run.run_id $TETHER_RUN_ID --buffer.redis_url $REDIS_URL"
LONG_RUNNING = ("redis", "reward", "learner-cpu", "rollout-cpu")

TIMINGS: dict[str, float] = {}
FIGURES: dict[str, str] = {}


def _env(steps: int, dummy: Path) -> dict[str, str]:
    return {
        "TETHER_AUTH_TOKEN": os.urandom(24).hex(),
        "REDIS_PASSWORD": os.urandom(24).hex(),
        "TETHER_RUN_ID": RUN_ID,
        "TETHER_IMAGE_CPU": TETHER_IMAGE,
        "TETHER_LEARNER_ARGS": f"--learner.total_steps {steps} --learner.checkpoint_every {CHECKPOINT_EVERY}",
        "MODEL_DIR": str(dummy),  # the GPU services' bind mounts: required to render the file, unused on CPU
        "DATA_DIR": str(dummy),
        "ROLLOUT_CPU_REPLICAS": "2",  # the file's `scale:`, so `down` knows both replicas (see the compose file)
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    missing = [tool for tool in ("podman", "runc", "iptables", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run through `make test-compose`, which installs them")
    logs = tmp_path_factory.mktemp("compose-logs")
    t0 = time.monotonic()
    build_images(logs, TIMINGS)
    TIMINGS["all image builds"] = time.monotonic() - t0
    for image in (DEBIAN_IMAGE, PYTHON_IMAGE, REDIS_IMAGE, TETHER_IMAGE):
        FIGURES[f"image size {image}"] = f"{image_size_mb(image):.0f} MB"
    s = Stack(f"tether-ci-{os.getpid()}", _env(FIRST_STEPS, tmp_path_factory.mktemp("unused")))
    try:
        with s.ticker:
            yield s
    finally:
        t0 = time.monotonic()
        s.teardown()
        TIMINGS["teardown"] = time.monotonic() - t0
        _print_report()
    assert s.leftovers() == [], "teardown left these behind"


def _print_report() -> None:
    print("\n== make test-compose: phases (taken on a shared 2-core machine)")
    for name, seconds in TIMINGS.items():
        print(f"  {name:<52} {seconds:7.1f} s")
    for name, value in FIGURES.items():
        print(f"  {name:<52} {value}")


def _wait(what: str, check: Callable[[], object], timeout: float, stack: Stack, every: float = 2.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{stack.logs()}")


def _metrics(stack: Stack) -> list[dict]:
    """The learner's metrics rows with a reward, read from the ``runs`` volume (the learner may have exited)."""
    path = stack.volume_path("runs") / RUN_ID / "metrics.jsonl"
    rows = []
    for line in (path.read_text() if path.exists() else "").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if row.get("reward/mean") is not None:
            rows.append(row)
    return rows


def _status(stack: Stack) -> str:
    """``tether status`` through compose exec, in the first replica (the learner exits when done; the second
    replica is the one killed: podman-compose's exec reaches only a scaled service's first container)."""
    return stack.compose("exec", "rollout-cpu", "sh", "-c", STATUS, timeout=120).stdout


def _servers(status: str) -> dict[str, int]:
    """Live rollout servers in a ``tether status`` text: id → policy version."""
    rows = re.findall(r"^\s+(\S+-\d+)\s+(\S+:\d+)\s+\S+\s+(\d+)\s+[\d.]+s$", status, re.MULTILINE)
    return {server_id: int(version) for server_id, _, version in rows}


def _policy_version(status: str) -> int:
    return int(re.search(r"policy version (\d+)", status).group(1))


def _wait_step(stack: Stack, step: int, timeout: float) -> list[dict]:
    return _wait(
        f"learner step {step}", lambda: (rows := _metrics(stack)) and rows[-1]["step"] >= step and rows, timeout, stack
    )


def test_tether_image_is_non_root_layered_and_copies_only_the_project(stack: Stack) -> None:
    config = json.loads(podman("image", "inspect", TETHER_IMAGE).stdout)[0]["Config"]
    assert config["User"] == "tether"
    uid = podman("run", "--rm", TETHER_IMAGE, "id", "-u").stdout.strip()
    assert uid == "10001"
    # Layers from least to most often changed: torch, then the dependencies, then the source.
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", TETHER_IMAGE).stdout.splitlines()[::-1]
    markers = ("torch==2.13.0", "requirements.txt", "in ./tether", "pip install --no-cache-dir --no-deps")
    order = [next(i for i, line in enumerate(history) if marker in line) for marker in markers]
    assert order == sorted(order), history
    # .dockerignore honoured and only what the image needs copied: no caches, tests, .git or venv.
    # (pip's cache is a build mount: its mount point stays, empty)
    look = "ls -A /app; find /app -name __pycache__ -o -name '*.pyc'; find /root/.cache -mindepth 1"
    listing = podman("run", "--rm", "--user", "0", TETHER_IMAGE, "sh", "-c", look).stdout
    assert set(listing.split()) == {
        "README.md",
        "pyproject.toml",
        "protos",
        "tether",
        "buffer",
        "rollout_server",
        "learner",
        "weight_sync",
        "examples",
        "deploy",
    }


def test_compose_file_renders_both_profiles_with_health_checks_and_valid_configs(stack: Stack) -> None:
    cpu = yaml.safe_load(stack.compose("config").stdout)["services"]
    assert set(LONG_RUNNING) <= set(cpu)
    for name in LONG_RUNNING:
        assert cpu[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert "--resume" in " ".join(cpu["learner-cpu"]["command"])
    gpu = yaml.safe_load(stack.compose("config", profile="gpu").stdout)["services"]
    for name in ("learner", "rollout"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert gpu[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert "--resume" in " ".join(gpu["learner"]["command"])
    assert gpu["learner"]["image"] == gpu["rollout"]["image"] == "tether:gpu"
    # Every config the compose file names validates with the tether of the image.
    check = (
        "from tether.config import load_config\n"
        "for name in ('cpu', 'gpu', 'gpu-one'):\n"
        "    cfg = load_config(f'/etc/tether/{name}.yaml', [])\n"
        "    print(name, cfg.learner.metrics_port, cfg.rollout.port)\n"
    )
    configs = f"{REPO / 'deploy' / 'configs'}:/etc/tether:ro"
    out = podman("run", "--rm", "-v", configs, TETHER_IMAGE, "python", "-c", check, timeout=180).stdout
    assert out.split("\n")[:3] == ["cpu 9400 50051", "gpu 9400 50051", "gpu-one 9400 50051"], out


def test_cpu_stack_trains_survives_a_killed_replica_and_resumes_after_down_up(stack: Stack) -> None:
    # --- up, as the README says, with two rollout replicas
    t0 = time.monotonic()
    stack.compose("up", "-d", timeout=600)
    TIMINGS["compose up -d (returns)"] = time.monotonic() - t0
    _wait_step(stack, 1, 600)
    TIMINGS["up -> first learner step"] = time.monotonic() - t0

    # --- tether status through compose exec while the learner trains (its versions advance from here)
    first = _status(stack)
    assert re.search(r"rollout servers: [12] live", first), first

    # --- SIGKILL one replica's process while the learner trains: the restart policy brings it back
    victim = stack.container("rollout-cpu", 2)
    before = stack.inspect(victim)
    step_at_kill = _metrics(stack)[-1]["step"]  # the policy version published after step k is k
    assert step_at_kill <= FIRST_STEPS - 2, "the learner is nearly done before the kill: raise FIRST_STEPS"
    t0 = time.monotonic()
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    _wait(
        "the killed replica to be restarted",
        lambda: (st := stack.inspect(victim))["RestartCount"] > before["RestartCount"] and st["State"]["Running"],
        120,
        stack,
    )
    TIMINGS["SIGKILL -> replica restarted by its policy"] = time.monotonic() - t0
    _wait_step(stack, step_at_kill + 2, 300)  # training went on

    # --- every service's health check passes, the restarted replica's included; Redis keeps an AOF
    for name in ("redis_1", "reward_1", "learner-cpu_1", "rollout-cpu_1", "rollout-cpu_2"):
        container = f"{stack.project}_{name}"
        _wait(f"{container} healthy", lambda c=container: stack.health(c) == "healthy", 300, stack)
    aof = stack.compose("exec", "redis", "redis-cli", "config", "get", "appendonly").stdout.split()
    assert aof[-1].strip('"') == "yes", aof

    # --- tether status: versions advanced, and the restarted replica is one of two live servers at the
    # current policy version
    def rejoined() -> str | None:
        status = _status(stack)
        servers, version = _servers(status), _policy_version(status)
        back = [v for sid, v in servers.items() if sid.startswith(before["Config"]["Hostname"])]
        ok = len(servers) == 2 and back == [version] and version > max(_policy_version(first), step_at_kill)
        return status if ok else None

    rejoin_status = _wait("the restarted replica at the current, advancing version", rejoined, 300, stack, every=3)
    TIMINGS["SIGKILL -> replica serving the current version"] = time.monotonic() - t0
    FIGURES["kill/restart"] = (
        f"killed after step {step_at_kill}; restarted, serving policy version {_policy_version(rejoin_status)} "
        f"(status before: {_policy_version(first)}) while the learner trained on"
    )

    rows = _wait_step(stack, FIRST_STEPS, 600)
    assert [r["step"] for r in rows] == list(range(1, FIRST_STEPS + 1))
    span = rows[-1]["time"] - rows[0]["time"]
    FIGURES["learner steps/s in containers (lifetime 1)"] = f"{(len(rows) - 1) / span:.3f}"
    assert rows[-1]["data/version_max"] >= 1

    # --- down, then up again: the learner resumes from its checkpoint, Redis (AOF) keeps the books
    t0 = time.monotonic()
    with stack.ticker.paused():
        stack.compose("down", "-t", "20", timeout=300)
    TIMINGS["compose down"] = time.monotonic() - t0
    label = f"label=io.podman.compose.project={stack.project}"
    left = podman("ps", "-a", "--filter", label, "--format", "{{.Names}} {{.Status}}").stdout.strip()
    assert left == "", f"compose down left containers:\n{left}"
    stack.env["TETHER_LEARNER_ARGS"] = (
        f"--learner.total_steps {SECOND_STEPS} --learner.checkpoint_every {CHECKPOINT_EVERY}"
    )
    t0 = time.monotonic()
    stack.compose("up", "-d", timeout=600)
    rows = _wait_step(stack, FIRST_STEPS + 1, 600)
    TIMINGS["second up -> first resumed step"] = time.monotonic() - t0
    rows = _wait_step(stack, SECOND_STEPS, 600)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, SECOND_STEPS + 1)), steps  # resumed at FIRST_STEPS + 1, nothing redone
    logged = podman("logs", stack.container("learner-cpu"))
    loaded = [json.loads(line) for line in (logged.stdout + logged.stderr).splitlines() if "checkpoint_loaded" in line]
    assert [e["path"] for e in loaded] == [f"/runs/{RUN_ID}/checkpoints/step_{FIRST_STEPS}"], loaded

    final = _wait(
        "the learner hash to show the last step",
        lambda: (s := _status(stack)) and f"learner step {SECOND_STEPS}" in s and s,
        120,
        stack,
    )
    assert "(balanced)" in final, final
    lives = re.findall(r"lifetime (\d+) \(from step (\d+)\)", final)
    assert lives == [("1", "0"), ("2", str(FIRST_STEPS))], final

    # --- the reward rose over the run (the demo task is learnable by the tiny model at this lr)
    rewards = [r["reward/mean"] for r in rows]
    early, late = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    FIGURES["reward mean, steps 1-4 -> last 4"] = f"{early:.3f} -> {late:.3f}"
    assert late > early, rewards
