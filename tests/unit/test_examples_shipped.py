"""The examples run from the README's commands: their configs load, their data ships, a wrong address is
one clear line within the wait asked for — not a bare ``FutureTimeoutError`` traceback after 120 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tether.config import load_config
from tether.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


def test_example_configs_load_and_point_at_shipped_files() -> None:
    math = load_config(REPO / "configs/examples/math-reward.yaml", [])
    assert math.rollout.reward.type == "remote"
    rows = [json.loads(line) for line in (REPO / math.learner.data_path).read_text().splitlines()]
    assert len(rows) >= 100 and all(r["prompt"] and r["answer"] for r in rows)  # what the reward service reads
    game = load_config(REPO / "configs/examples/guessing-game.yaml", [])
    assert game.rollout.port == 50051 and game.rollout.prompt_workers == 0 and game.learner.data_path == ""
    agent = load_config(REPO / "configs/examples/openai-agent.yaml", [])
    assert agent.rollout.openai.port == 8000 and agent.rollout.prompt_workers == 0


def test_readme_gives_the_example_commands() -> None:
    readme = (REPO / "README.md").read_text()
    for command in (
        "tether up --config configs/examples/guessing-game.yaml",
        "python examples/guessing_game.py --server 127.0.0.1:50051",
        "python examples/reward_service.py --port 50070",
        "tether up --config configs/examples/math-reward.yaml",
        "python examples/reward_model_service.py --make-tiny .cache/tiny-rm",
        "tether up --config configs/examples/openai-agent.yaml",
        "python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1",
    ):
        assert command in readme, command


def test_guessing_game_at_a_dead_address_says_so_and_exits() -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "examples/guessing_game.py", "--server", address, "--wait-s", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "FutureTimeoutError" not in proc.stderr
    assert f"no rollout server answered at {address}" in proc.stderr
    assert "configs/examples/guessing-game.yaml" in proc.stderr


def test_openai_agent_at_a_dead_address_says_so_and_exits() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = subprocess.run([sys.executable, "examples/openai_agent.py", "--base-url", url, "--wait-s", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{url} did not answer within 1s" in proc.stderr
