"""The cost of the OpenAI door, and what a naive proxy would train on instead.

    python bench/openai_door.py [--quick] [--repeats N] [--model DIR] [--max-tokens T] [--part all|speed|exact]

**HTTP vs gRPC** (``openai_door/http_vs_grpc_<c>clients``, goal ≥ 0.9): one rollout server process serves both its
gRPC API and its OpenAI door. Two load processes of their own drive it with the same chat prompts, one sample
each, the same ``max_tokens`` and temperature 1: one through ``AsyncRolloutClient.generate`` (messages → the
server renders the chat template — what a gRPC client sends), the other through the ``openai`` package's
``AsyncOpenAI.chat.completions.create`` (what an agent sends). The driver only hands each "run n requests with c
clients" over a pipe and reads back (tokens, seconds). Each concurrency level (1, 8, 64 clients, one request at a
time each) runs ``--repeats`` times (5; 3 with ``--quick``) on both sides back to back, the side that goes first
alternating, after a warm-up of both; the figure is the median of the per-repeat ratios (HTTP tok/s ÷ gRPC tok/s)
with their min–max. Timings are printed, never asserted. The default model is a tiny one (128 wide × 2 layers),
where a fixed per-request cost weighs most: the worst case a CPU can show.

**Token-exactness** (counts, not times): ``--episodes`` multi-turn chat episodes (3 turns) are played through the
door. For each, what tether trains on is the server's record, which the response's ``tether.token_ids`` carry;
a naive proxy would train on the transcript's text re-encoded. Reported: the turns whose text, encoded again,
is not their sampled ids, and the fraction of sampled tokens from each turn's first difference on (where the
naive record stops being what the model produced) — tether's are 0 by construction (checked by
``tests/integration/test_openai_door.py``, id for id). On a byte-level tokenizer re-encoding differs where the
model sampled bytes that are not valid UTF-8 or special tokens; on a BPE tokenizer (``--model`` a real one)
also where the sampled split is not the canonical one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report
from bench.rollout import RESULT, Worker, drive

CONCURRENCY = (1, 8, 64)
MESSAGES = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Tell me about {i}."}]
            for i in range(64)]  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests, repeats and tokens (for tests)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats per concurrency (default 5; 3 quick)")
    p.add_argument("--model", default="", help="local HF model folder with a chat template (default: tiny, built now)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 16 quick / 48)")
    p.add_argument("--episodes", type=int, default=0, help="episodes of the token-exactness count (8 quick / 32)")
    p.add_argument("--part", default="all", choices=["all", "speed", "exact"])
    p.add_argument("--worker", choices=["grpc", "http"], help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    return p.parse_args(argv)


async def load_worker(args: argparse.Namespace) -> int:
    """A load process: warm up, say ready, then answer one ``{"n", "c"}`` line on stdin per run."""
    if args.worker == "grpc":
        from tether.client import AsyncRolloutClient

        client = AsyncRolloutClient(args.address, timeout_s=600)

        async def call(i: int) -> int:
            out = await client.generate(messages=MESSAGES[i % len(MESSAGES)], n=1, max_tokens=args.max_tokens,
                                        temperature=1.0)  # fmt: skip
            return len(out.samples[0].token_ids)

        close = client.close
    else:
        import httpx2
        import openai

        limits = httpx2.Limits(max_connections=128, max_keepalive_connections=128)
        client_h = openai.AsyncOpenAI(base_url=args.base_url, api_key="-", max_retries=0, timeout=600,
                                      http_client=httpx2.AsyncClient(limits=limits))  # fmt: skip

        async def call(i: int) -> int:
            out = await client_h.chat.completions.create(model="m", messages=MESSAGES[i % len(MESSAGES)], n=1,
                                                         max_tokens=args.max_tokens, temperature=1.0)  # fmt: skip
            return out.usage.completion_tokens

        close = client_h.close
    try:
        await drive(call, 8, 4)  # warm-up: connections, first-call allocations
        print(RESULT + json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            job = json.loads(line)
            tokens, seconds = await drive(call, job["n"], job["c"])
            print(RESULT + json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
    finally:
        await close()
    return 0


class Load(Worker):
    """The driver's handle on a load process (bench/rollout.py's, with this script's command line)."""

    def __init__(self, side: str, args: argparse.Namespace, *, address: str, base_url: str) -> None:
        cmd = [sys.executable, __file__, "--worker", side, "--max-tokens", str(args.max_tokens),
               "--address", address, "--base-url", base_url]  # fmt: skip
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # ready

    def rate(self, n: int, c: int) -> float:
        """Generated tokens/s of ``n`` requests from ``c`` clients."""
        return self.run(n=n, c=c)["rate"]


def start_server(model: str, max_tokens: int, tmp: Path, *, buffer: str = ""):  # type: ignore[no-untyped-def]
    from rollout_server.launch import spawn_server
    from tether.redis_server import free_port

    http = free_port()
    engine = "{type: transformers, max_num_seqs: 64, batch_wait_ms: 10}"
    args = ["--model.path", model, "--rollout.engine", engine, "--rollout.max_tokens", str(max_tokens),
            "--rollout.prompt_workers", "0", "--rollout.openai.port", str(http),
            "--rollout.max_prompt_len", "2000"]  # fmt: skip
    if buffer:
        args += ["--run.run_id", f"door-bench-{uuid.uuid4().hex[:6]}", "--buffer.redis_url", buffer,
                 "--run.output_dir", str(tmp / "runs")]  # fmt: skip
    server = spawn_server(args, port=free_port(), log_path=tmp / f"server-{http}.log", wait_s=600)
    return server, f"http://127.0.0.1:{http}/v1"


def http_vs_grpc(args: argparse.Namespace, model: str, repeats: int, tmp: Path) -> list:
    print("starting the rollout server (gRPC + OpenAI door) and the two load processes ...", flush=True)
    server, base_url = start_server(model, args.max_tokens, tmp)
    loads: dict[str, Load] = {}
    rows, turn = [], 0
    try:
        for side in ("grpc", "http"):
            loads[side] = Load(side, args, address=server.address, base_url=base_url)
        for c in CONCURRENCY:
            n = max(2 * c, 8) if args.quick else max(4 * c, 32)
            rates: dict[str, list[float]] = {"grpc": [], "http": []}
            for _ in range(repeats):
                for side in ordered(["grpc", "http"], turn):
                    rates[side].append(loads[side].rate(n, c))
                turn += 1
            rows.append((c, n, rates))
            print(f"  {c:>3} clients: gRPC {statistics.median(rates['grpc']):9.1f} tok/s, HTTP "
                  f"{statistics.median(rates['http']):9.1f} tok/s (medians)", flush=True)  # fmt: skip
    finally:
        for load in loads.values():
            load.close()
        server.terminate()
    figures = []
    for c, n, rates in rows:
        ratios = [h / g for h, g in zip(rates["http"], rates["grpc"], strict=True)]
        figures.append(figure(
            f"openai_door/http_vs_grpc_{c}clients", ratios, goal=0.9, direction="min",
            baseline=f"gRPC Generate of the same server with the same chat prompts ({c} clients, {n} requests, "
            f"{args.max_tokens} tokens each), from a load process of its own",
        ))  # fmt: skip
    return figures


def naive_mismatch(args: argparse.Namespace, model: str, tmp: Path) -> list:
    """Play episodes through the door; count what re-encoding each reply's text would get wrong."""
    import openai
    from transformers import AutoTokenizer

    from tether.prompts import encode_continuation
    from tether.redis_server import EmbeddedRedis

    tok = AutoTokenizer.from_pretrained(model)
    redis = EmbeddedRedis(tmp / "redis")
    url = redis.start()
    server, base_url = start_server(model, args.max_tokens, tmp, buffer=url)
    wrong = sampled = turns_wrong = 0
    try:
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)
        chat = bool(tok.chat_template)  # a base model without one plays text episodes on /v1/completions
        for k in range(args.episodes):
            eid = f"exact-{k}"
            messages = [{"role": "user", "content": f"Tell me a story about the number {k}."}]
            prompt = f"A story about the number {k}:"
            for turn in range(3):
                if chat:
                    out = client.chat.completions.create(model="m", messages=messages, max_tokens=args.max_tokens,
                                                         extra_headers={"X-Tether-Episode": eid})  # fmt: skip
                    text = out.choices[0].message.content or ""
                else:
                    out = client.completions.create(model="m", prompt=prompt, max_tokens=args.max_tokens,
                                                    extra_headers={"X-Tether-Episode": eid})  # fmt: skip
                    text = out.choices[0].text
                ids = out.choices[0].model_extra["tether"]["token_ids"]
                # The naive proxy's record of this turn: the reply's text encoded again (plus the stop token it
                # ended on, which the text no longer holds but a template would write back).
                again = encode_continuation(tok, text) + ids[len(ids) - 1 :] * (out.choices[0].finish_reason == "stop")
                same = next((i for i, (a, b) in enumerate(zip(again, ids, strict=False)) if a != b),
                            min(len(again), len(ids)))  # fmt: skip
                wrong += len(ids) - same  # from the first difference on, the turn is trained on other tokens
                turns_wrong += again != ids
                sampled += len(ids)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
                prompt += f"{text}\nAnd {turn}?\n"
            client.post(f"/episodes/{eid}/reward", body={"reward": 0.0}, cast_to=object)
    finally:
        server.terminate()
        redis.stop()
    fraction = wrong / max(sampled, 1)
    print(f"  naive re-encoding: {turns_wrong} of {3 * args.episodes} turns differ; {wrong} of {sampled} sampled "
          f"tokens ({fraction:.2%}) from a turn's first difference on; tether: 0 and 0", flush=True)  # fmt: skip
    return [figure(
        "openai_door/naive_proxy_wrong_token_fraction", [fraction], goal=None, direction="max",
        baseline=f"tether's record (0 wrong by construction); {args.episodes} episodes x 3 turns, "
        f"{Path(model).name}", note="a count, not a timing",
    )]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.max_tokens = args.max_tokens or (16 if args.quick else 48)
    args.episodes = args.episodes or (8 if args.quick else 32)
    if args.worker:
        return asyncio.run(load_worker(args))
    repeats = max(3, args.repeats or (3 if args.quick else 5))
    tmp = Path(tempfile.mkdtemp(prefix="tether-door-bench-"))
    model = args.model
    if not model:
        from tether.commands.tiny_model import make_tiny_model

        model = str(make_tiny_model(tmp / "tiny", hidden=128, layers=2, heads=4, seed=0))
    print(f"model={model} max_tokens={args.max_tokens} quick={args.quick} repeats={repeats}", flush=True)
    figures = []
    if args.part in ("all", "speed"):
        figures += http_vs_grpc(args, model, repeats, tmp)
    if args.part in ("all", "exact"):
        figures += naive_mismatch(args, model, tmp)
    print()
    for fig in figures:
        report(fig, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
