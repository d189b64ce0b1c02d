"""Does the rollout server serve the learner's weights? Watch a running run and, after each weight update, ask the
server for a greedy completion and compare it with the learner's own weights' greedy completion.

    tether up --config configs/gemma-addition.yaml --rollout.engine.type vllm --rollout.port 50061   # terminal 1
    python examples/greedy_check.py --server 127.0.0.1:50061 --run runs/<run_id>                     # terminal 2

Every ``--every-s`` seconds the server gets one Generate at temperature 0 (it is served like any request, and
never enters the replay buffer). When all of a completion's tokens carry one policy version ``v`` not yet
checked, the learner's weights of ``v`` (the filesystem snapshot ``{run}/snapshots/v…``, written on every
publication; the base model for ``v`` 0) are loaded into a transformers model, which completes the same prompt
ids greedily. Each version prints one line — the two completions, whether their tokens are equal, and how far
apart the server's log-probs of its tokens are from the learner's (both are of the T = 1 distribution).
Exits 1 if any version differs, 0 when the server is gone (the run ended) with every checked version equal.

Keep ``weight_sync.keep_snapshots`` above how many versions the learner publishes while one check runs (a few
seconds on 2 cores); a version whose snapshot is already pruned is counted as unchecked, never as equal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Runs from a checkout without installing: make the repo's `tether` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _learner_model(run: Path):  # type: ignore[no-untyped-def]
    """The run's model (its config's ``model.path``, a GGUF resolved to its converted folder) in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.config.loader import load_config
    from tether.model_path import with_model_folder

    folder = with_model_folder(load_config(run / "config.yaml")).model.path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder), folder


def _load_version(model, folder: str, snapshots: Path, version: int) -> bool:  # type: ignore[no-untyped-def]
    """The learner's weights of ``version`` into ``model``; False when its snapshot is gone (pruned)."""
    from weight_sync.snapshot import read_snapshot, snapshot_dir

    # A snapshot reads as a Hugging Face folder does (its index, else every shard): the base is the model's folder.
    path = Path(folder) if version == 0 else snapshot_dir(snapshots, version)
    try:
        tensors = dict(read_snapshot(path))
    except (OSError, ValueError):
        return False
    state = model.state_dict()
    for name, tensor in tensors.items():
        if name in state:
            state[name].copy_(tensor.to(state[name].dtype))
    missing = [n for n in state if n not in tensors and not _tied(model, n)]
    if missing:
        raise SystemExit(f"snapshot v{version} lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return True


def _tied(model, name: str) -> bool:  # type: ignore[no-untyped-def]
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _learner_greedy(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_scores=False,
                             return_dict_in_generate=False, pad_token_id=model.config.eos_token_id)  # fmt: skip
        completion = out[0, len(prompt_ids) :].tolist()
        logits = model(out[:, :-1]).logits.float()[0, len(prompt_ids) - 1 :]
        logprobs = torch.log_softmax(logits, -1).gather(-1, out[0, len(prompt_ids) :, None])[:, 0]
    return completion, logprobs.tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="host:port of the run's rollout server")
    p.add_argument("--run", type=Path, required=True, help="the run's folder (its snapshots and config)")
    p.add_argument("--snapshots", type=Path, help="snapshot folder (default {run}/snapshots)")
    p.add_argument("--prompt", help="default: the first held-out prompt of demo:fewshot_addition")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--every-s", type=float, default=2.0)
    p.add_argument(
        "--versions", type=int, default=0, help="stop after checking this many versions (0: until the run ends)"
    )
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="how long to wait for the server to answer")
    args = p.parse_args(argv)

    import grpc

    from tether.client import RolloutClient
    from tether.tasks import fewshot_addition_rows

    prompt = args.prompt or next(fewshot_addition_rows(seed=0, split="val"))["prompt"]
    snapshots = args.snapshots or args.run / "snapshots"
    deadline = time.monotonic() + args.start_timeout_s
    while not (args.run / "config.yaml").exists() and time.monotonic() < deadline:  # tether up writes it first
        time.sleep(0.2)
    model, tokenizer, folder = _learner_model(args.run)  # before the server is up: a short run may be quick
    client = RolloutClient(args.server)
    client.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))
    checked: dict[int, bool] = {}
    unchecked: set[int] = set()
    failures = 0
    while failures < 5 and (not args.versions or len(checked) < args.versions):
        try:
            resp = client.generate(text=prompt, temperature=0.0, max_tokens=args.max_tokens, timeout_s=120)
        except grpc.RpcError as e:
            failures += 1
            print(f"server: {e.code().name} ({failures}/5)", flush=True)
            time.sleep(args.every_s)
            continue
        failures = 0
        sample = resp.samples[0]
        versions = set(sample.policy_versions)
        if len(versions) == 1 and (v := versions.pop()) not in checked and v not in unchecked:
            if not _load_version(model, folder, snapshots, v):
                unchecked.add(v)
                print(f"v{v}: snapshot already pruned — not checked", flush=True)
                continue
            ids, logprobs = _learner_greedy(model, list(resp.prompt_token_ids), len(sample.token_ids))
            equal = ids == list(sample.token_ids)
            gap = max((abs(a - b) for a, b in zip(sample.logprobs, logprobs, strict=False)), default=0.0)
            checked[v] = equal
            print(f"v{v}: server {sample.text!r} {'==' if equal else '!='} learner {tokenizer.decode(ids)!r}, "
                  f"max |log-prob gap| {gap:.2e}", flush=True)  # fmt: skip
        time.sleep(args.every_s)
    client.close()
    same = sum(checked.values())
    print(f"greedy check: {same}/{len(checked)} versions equal ({sorted(checked)}), {len(unchecked)} unchecked")
    return 0 if checked and same == len(checked) else 1


if __name__ == "__main__":
    raise SystemExit(main())
