"""Named LoRA adapters per request on one vLLM engine (vllm-cpu): what a fleet's LoRA runs of one base share.

One ``VllmEngine(named_adapters=True)``, in a subprocess running this file as a script (vLLM spawns; it
starts in ~60 s on two cores), loads adapters ``run-a`` (rank 2, scale 2, as version 3) and ``run-b``
(rank 4, scale 1, version 5) and generates, concurrently, rows of ``run-a``, of ``run-b`` and of the base:

* each row's log-probs are its own merged model's (``W0 + scale * B @ A``, a transformers forward pass
  over the tokens vLLM produced), and each row is tagged with its adapter's version (0 for the base);
* an update of ``run-a`` (a new version 4) while a request of ``run-a`` is running: the running request
  ends on version 3's adapter, tagged 3 throughout; a request after the update gets version 4, tagged 4;
* ``remove_adapter("run-b")`` frees it: a request naming it then is refused, and ``run-a`` stays.
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

PROMPT = [60, 61, 62, 63, 64, 65, 66, 67]
HELD = [70, 71, 72, 73]
ADAPTERS = {"run-a": (2, 2.0, 1), "run-b": (4, 1.0, 2), "run-a-v4": (2, 2.0, 3)}
"""name: (rank, scale, seed) of each adapter; ``run-a-v4`` is the second version of ``run-a``."""
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def make_adapter(model_dir: Path, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Random A and B (B non-zero, so the adapter changes the model) for TARGETS, under peft's names."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        if name.endswith(".weight") and any(t in name for t in TARGETS):
            stem = "base_model.model." + name.removesuffix(".weight")
            out[stem + ".lora_A.weight"] = torch.randn(rank, w.shape[1], generator=gen) * 0.2
            out[stem + ".lora_B.weight"] = torch.randn(w.shape[0], rank, generator=gen) * 0.2
    return out


async def _script(model_dir: str, workdir: str) -> dict:
    import asyncio

    from safetensors.torch import save_file

    from rollout_server.engines.base import SamplingSpec
    from rollout_server.engines.vllm_engine import VllmEngine
    from tether.config import TetherConfig

    cfg = TetherConfig.model_validate(
        {
            "run": {"run_id": "vllm-adapters", "output_dir": str(Path(workdir) / "runs")},
            "model": {"path": model_dir, "max_model_len": 512},
            "rollout": {
                "engine": {"type": "vllm", "enforce_eager": True, "cpu_kvcache_space_gb": 1, "max_num_seqs": 8,
                           "max_loras": 4, "max_lora_rank": 8},
            },
        }
    )  # fmt: skip
    adapters = {}
    for name, (rank, _, seed) in ADAPTERS.items():
        adapters[name] = make_adapter(Path(model_dir), rank, seed)
        save_file(adapters[name], str(Path(workdir) / f"{name}.safetensors"))
    engine = VllmEngine(cfg, named_adapters=True)
    await engine.start()
    await engine.load_adapter(adapters["run-a"].items(), version=3, scale=ADAPTERS["run-a"][1], name="run-a")
    await engine.load_adapter(adapters["run-b"].items(), version=5, scale=ADAPTERS["run-b"][1], name="run-b")

    def spec(adapter: str, **kw) -> SamplingSpec:
        return SamplingSpec(**{"n": 2, "temperature": 1.0, "max_tokens": 12, "seed": 7, "adapter": adapter, **kw})

    def rows(samples) -> list[dict]:
        return [{"tokens": s.token_ids, "logprobs": s.logprobs, "versions": s.versions} for s in samples]

    mixed = await asyncio.gather(*(engine.generate(PROMPT, spec(a)) for a in ("run-a", "run-b", "")))
    result: dict = {"mixed": {a or "base": rows(s) for a, s in zip(("run-a", "run-b", ""), mixed, strict=True)}}

    held = engine.stream(HELD, spec("run-a", n=1, temperature=0.0, max_tokens=200), request_id="held")
    chunks = [await held.__anext__()]
    v3 = engine._named.current["run-a"]  # the test reads which requests hold version 3
    await engine.load_adapter(adapters["run-a-v4"].items(), version=4, scale=ADAPTERS["run-a-v4"][1], name="run-a")
    result["held_across_update"] = "held" in v3.requests
    result["after"] = rows(await engine.generate(PROMPT, spec("run-a")))
    chunks += [c async for c in held]
    result["held"] = {"tokens": [t for c in chunks for t in c.token_ids],
                      "logprobs": [x for c in chunks for x in c.logprobs],
                      "versions": [v for c in chunks for v in c.versions]}  # fmt: skip

    await engine.remove_adapter("run-b")
    try:
        await engine.generate(PROMPT, spec("run-b"))
        result["removed"] = "generated"
    except Exception as e:
        result["removed"] = f"{type(e).__name__}: {e}"
    result["adapters"] = engine.adapters
    await engine.shutdown()
    return result


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("vllm-adapters")
    out = tmp / "result.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(tiny_model_dir), str(tmp), str(out)], env=env,
                          capture_output=True, text=True, timeout=540)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return {**json.loads(out.read_text()), "dir": tmp, "model": tiny_model_dir}


def merged_model(model_dir: Path, adapter: Path | None, scale: float):
    """The base with ``adapter`` (a saved file) merged, as peft's merge_and_unload computes it."""
    from safetensors.torch import load_file

    from tests.helpers import merged_lora_model  # here: the script side of this file never needs it

    return merged_lora_model(model_dir, load_file(str(adapter)) if adapter else {}, scale)


def logprobs_of(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _check(model, prompt: list[int], row: dict) -> None:
    assert row["tokens"], "no tokens generated"
    want = logprobs_of(model, prompt, row["tokens"])
    torch.testing.assert_close(torch.tensor(row["logprobs"]), want, atol=2e-3, rtol=1e-3)


def test_each_row_generates_with_its_own_adapter(played: dict) -> None:
    base = merged_model(played["model"], None, 0.0)
    for name, version in (("run-a", 3), ("run-b", 5), ("base", 0)):
        if name == "base":
            model = base
        else:
            model = merged_model(played["model"], played["dir"] / f"{name}.safetensors", ADAPTERS[name][1])
        for row in played["mixed"][name]:
            _check(model, PROMPT, row)
            assert set(row["versions"]) == {version}
    # the adapters really change the model: run-a's rows are not the base's
    row = played["mixed"]["run-a"][0]
    assert (logprobs_of(base, PROMPT, row["tokens"]) - torch.tensor(row["logprobs"])).abs().max() > 0.05


def test_an_update_reaches_new_requests_and_a_running_one_ends_on_its_version(played: dict) -> None:
    v3 = merged_model(played["model"], played["dir"] / "run-a.safetensors", ADAPTERS["run-a"][1])
    v4 = merged_model(played["model"], played["dir"] / "run-a-v4.safetensors", ADAPTERS["run-a-v4"][1])
    held = played["held"]
    assert played["held_across_update"], "the held request ended before the update: nothing was tested"
    assert len(held["tokens"]) > 1 and set(held["versions"]) == {3}
    _check(v3, HELD, held)
    for row in played["after"]:
        assert set(row["versions"]) == {4}
        _check(v4, PROMPT, row)


def test_a_removed_adapter_is_refused(played: dict) -> None:
    assert "run-b" in played["removed"] and "no adapter" in played["removed"]
    assert played["adapters"] == ["run-a"]


if __name__ == "__main__":
    import asyncio

    model_dir, workdir, out = sys.argv[1:4]
    Path(out).write_text(json.dumps(asyncio.run(_script(model_dir, workdir))))
