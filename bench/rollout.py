"""The rollout engine's speed: against ``model.generate`` on the same batch, and behind gRPC vs in-process.

    python bench/rollout.py [--quick] [--repeats N] [--model DIR] [--engine transformers|vllm]
                            [--part all|generate|grpc] [--batch B] [--max-tokens T]

**Engine vs ``model.generate``** (transformers engine only): one process of its own loads the model
twice — the engine, and a plain Hugging Face model — and times, alternating which goes first, the same
batch of ``--batch`` prompts (64; 16 with ``--quick``) on both: all submitted to the engine at once
(``engine.generate`` per prompt, gathered), and one left-padded ``model.generate`` call with the same
sampling (``do_sample``, temperature 1, no top-k / top-p) and the same ``max_new_tokens``; both stop a
row at EOS. The figure ``rollout/engine_vs_generate`` (goal ≥ 1.0) is generated tokens/s of the engine
÷ that of ``model.generate``, per repeat; the engine also computes each token's log-prob and policy
version, which ``model.generate`` does not.

**gRPC vs in-process**:

Both sides use the same engine type, settings and prompts in one run, and on both sides the load comes
from a process of its own that does nothing else:

* in-process (the baseline: what a user who embeds the engine would run): a worker process builds the
  engine and calls ``engine.generate`` from its own event loop;
* gRPC: ``python -m rollout_server`` as a child, driven by a separate worker process through
  ``AsyncRolloutClient``.

The driver (this process) only hands each worker "run n requests with c clients" over a pipe and reads
back (tokens, seconds); it holds no engine and runs no event loop while a side is timed. Each
concurrency level (1, 8, 64 clients, each sending one request at a time) runs ``--repeats`` times (7 by
default: on the 2-vCPU VM this project is measured on, per-repeat ratios at 1 and 8 clients spread ±15 %) on
both sides back to back, the side that goes first alternating, after a warm-up of both. The figure
``rollout/grpc_vs_inprocess_<c>clients`` (goal ≥ 0.95) is the median of the per-repeat ratios with
their min–max. Beside the timings each side prints what its engine ran over those repeats — rows per
decode pass and forward passes per 1k tokens (``Engine.step_counts``; the server's are read from its
Prometheus endpoint) — counts, not times, so a gap can be told from batching or from overhead even on a
busy machine. Both engines live for the whole run (idle while the other side is timed); on a machine
with few cores the server, its client process and the in-process worker share them, which is the
load a rollout host sees. Timings are printed, never asserted. With no ``--model`` a tiny model is
built in a temp folder: 128 wide × 2 layers, or ``--tiny WxL``. The gRPC path costs a fixed CPU time per
request, so the smaller the model the larger its share: the default is the worst case a CPU can show, and
a figure of another size carries it in its name (``rollout/grpc_vs_inprocess_64clients_256x4``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report
from tether.prompts import encode_prompt

CONCURRENCY = (1, 8, 64)
RESULT = "RESULT "  # worker stdout lines that carry an answer; anything else (library chatter) is ignored


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests and tokens (seconds, for tests)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (default 3; 7 for gRPC)")
    p.add_argument("--model", default="", help="local HF model folder (default: a tiny model built now)")
    p.add_argument(
        "--tiny", default="128x2", help="hidden x layers of the tiny model built when no --model (figures of "
        "another size than 128x2 carry it in their name)",
    )  # fmt: skip
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 16 quick / 64)")
    p.add_argument(
        "--batch", type=int, default=0, help="prompts of the engine vs generate batch (default 16 quick / 64)"
    )
    p.add_argument(
        "--requests-per-client", type=int, default=4, help="requests per client in a gRPC-vs-in-process run (min 32)"
    )
    p.add_argument("--part", default="all", choices=["all", "generate", "grpc"], help="which comparison to run")
    p.add_argument("--worker", choices=["local", "remote", "versus"], help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--metrics-url", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def size_suffix(args: argparse.Namespace) -> str:
    """``_<hidden>x<layers>`` for figures of a tiny model other than the default 128x2; nothing otherwise."""
    return "" if args.model or args.tiny == "128x2" else f"_{args.tiny}"


def overrides(model: str, engine: str, max_tokens: int) -> list[str]:
    engine_cfg = (
        "{type: transformers, max_num_seqs: 64, batch_wait_ms: 10}"
        if engine == "transformers"
        else "{type: vllm, enforce_eager: true, max_num_seqs: 64}"
    )
    return [
        *("--model.path", model, "--rollout.engine", engine_cfg),
        *("--rollout.max_tokens", str(max_tokens), "--rollout.max_n", "64", "--rollout.prompt_workers", "0"),
    ]


async def drive(call, n_requests: int, concurrency: int) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """Run ``n_requests`` calls with ``concurrency`` workers; returns (generated tokens, seconds)."""
    queue = list(range(n_requests))
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            tokens = await call(queue.pop())  # await first: `total += await ...` would read total before
            total += tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total, time.perf_counter() - start


def prompt_texts(count: int) -> list[str]:
    return [f"prompt number {i}: " for i in range(count)]


async def versus_worker(args: argparse.Namespace) -> int:
    """The engine and ``model.generate`` in one process: answer ``{"side", "n"}`` with (tokens, seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_server.engines import SamplingSpec, build_engine
    from tether.config import load_config

    engine = build_engine(load_config(None, overrides(args.model, args.engine, args.max_tokens)))
    await engine.start()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=engine.model.dtype).to(engine.device).eval()
    tok = engine.tokenizer
    ids = [encode_prompt(tok, p) for p in prompt_texts(args.batch)]
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=args.max_tokens)
    pad = tok.pad_token_id
    width = max(map(len, ids))
    batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=engine.device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=engine.device)
    eos = engine.model.generation_config.eos_token_id

    async def run_engine() -> int:
        outs = await asyncio.gather(*(engine.generate(x, spec) for x in ids))
        return sum(len(s.token_ids) for (s,) in outs)

    def run_generate() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=batch, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=args.max_tokens, eos_token_id=eos, pad_token_id=pad,
            )  # fmt: skip
        new = out[:, width:]
        # Tokens up to and including each row's EOS, as the engine counts them.
        done = (new == eos).int().cumsum(-1)
        return int(((done == 0) | ((done == 1) & (new == eos))).sum())

    await run_engine()  # warm-up of both
    run_generate()
    print(RESULT + json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            side = json.loads(line)["side"]
            start = time.perf_counter()
            tokens = await run_engine() if side == "engine" else run_generate()
            print(RESULT + json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}), flush=True)
    finally:
        await engine.shutdown()
    return 0


async def serve_worker(args: argparse.Namespace) -> int:
    """A load process: warm up, say ready, then answer one ``{"n", "c"}`` line on stdin per run."""
    from rollout_server.engines import SamplingSpec, build_engine
    from tether.config import load_config

    cfg = load_config(None, overrides(args.model, args.engine, args.max_tokens))
    prompts = prompt_texts(256)
    if args.worker == "local":
        engine = build_engine(cfg)
        await engine.start()
        spec = SamplingSpec(n=1, temperature=1.0, max_tokens=args.max_tokens)
        ids = [encode_prompt(engine.tokenizer, p) for p in prompts]

        async def call(i: int) -> int:
            (s,) = await engine.generate(ids[i % len(ids)], spec)
            return len(s.token_ids)

        close = engine.shutdown
        step_counts = engine.step_counts
    else:
        from transformers import AutoTokenizer

        from tether.client import AsyncRolloutClient

        tok = AutoTokenizer.from_pretrained(args.model)
        ids = [encode_prompt(tok, p) for p in prompts]
        client = AsyncRolloutClient(args.address, timeout_s=600)

        async def call(i: int) -> int:
            out = await client.generate(token_ids=ids[i % len(ids)], n=1, max_tokens=args.max_tokens, temperature=1.0)
            return len(out.samples[0].token_ids)

        close = client.close

        def step_counts() -> dict[str, int]:
            return scrape_step_counts(args.metrics_url)

    try:
        await drive(call, 4, 2)  # warm-up: first-call allocations, thread pools, channel connect
        print(RESULT + json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            job = json.loads(line)
            before = step_counts()
            tokens, seconds = await drive(call, job["n"], job["c"])
            after = step_counts()
            steps = {k: after[k] - before.get(k, 0) for k in after}
            print(RESULT + json.dumps({"tokens": tokens, "seconds": seconds, "steps": steps}), flush=True)
    finally:
        await close()
    return 0


def scrape_step_counts(url: str) -> dict[str, int]:
    """The server's ``Engine.step_counts`` from its Prometheus endpoint (``tether_rollout_engine_*``)."""
    import urllib.request

    counts: dict[str, int] = {}
    for line in urllib.request.urlopen(url, timeout=30).read().decode().splitlines():
        for metric, suffix in (("forward_passes", ""), ("rows", "_rows")):
            for kind in ("prefill", "decode"):
                if line.startswith(f'tether_rollout_engine_{metric}_total{{kind="{kind}"}} '):
                    counts[kind + suffix] = int(float(line.split()[-1]))
    return counts


def batch_shape(answers: list[dict]) -> str:
    """What the engine ran over these jobs: mean rows per decode pass, forward passes per 1k tokens."""
    total = {k: sum(a["steps"].get(k, 0) for a in answers) for k in ("prefill", "decode", "decode_rows")}
    if not total["decode"]:
        return "(this engine reports no step counts)"
    tokens = sum(a["tokens"] for a in answers)
    rows = total["decode_rows"] / max(total["decode"], 1)
    per_k = 1000 * (total["prefill"] + total["decode"]) / max(tokens, 1)
    return f"{rows:5.1f} rows/decode pass, {per_k:6.1f} passes/1k tokens ({total['prefill']} prefills)"


class Worker:
    """The driver's handle on a load process."""

    def __init__(
        self, args: argparse.Namespace, side: str, model: str, max_tokens: int, address: str = "", metrics_url: str = ""
    ) -> None:
        cmd = [sys.executable, __file__, "--worker", side, "--model", model, "--engine", args.engine]
        cmd += ["--max-tokens", str(max_tokens), "--batch", str(args.batch)]
        cmd += ["--address", address, "--metrics-url", metrics_url] if address else []
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # ready

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        raise RuntimeError(f"the {self.side} load process exited ({self.proc.wait()}) without answering")

    def run(self, **job: object) -> dict:
        """One job (``n`` requests from ``c`` clients; or one ``side`` of the versus): its answer, with
        ``rate`` (generated tokens/s) added."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        out = self._answer()
        return {**out, "rate": out["tokens"] / out["seconds"]}

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.max_tokens = max_tokens
    args.batch = args.batch or (16 if args.quick else 64)
    if args.worker == "versus":
        return asyncio.run(versus_worker(args))
    if args.worker:
        return asyncio.run(serve_worker(args))
    repeats = max(3, args.repeats or 3)
    tmp = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    model = args.model
    if not model:
        from tether.commands.tiny_model import make_tiny_model

        hidden, layers = (int(x) for x in args.tiny.split("x"))
        model = str(make_tiny_model(tmp / "tiny", hidden=hidden, layers=layers, heads=4, seed=0))
    print(f"engine={args.engine} model={model} max_tokens={max_tokens} quick={args.quick} repeats={repeats}")
    figures = []
    if args.engine == "transformers" and args.part in ("all", "generate"):
        figures.append(engine_vs_generate(args, model, repeats))
    if args.part in ("all", "grpc"):
        # 7 by default: on a 2-vCPU VM whose idle vCPUs halt, per-repeat ratios at 1 and 8 clients spread ±15 %.
        grpc_repeats = max(3, args.repeats or (3 if args.quick else 7))
        figures += grpc_vs_inprocess(args, model, grpc_repeats, tmp)
    print()
    for fig in figures:
        report(fig, quick=args.quick)
    return 0


def engine_vs_generate(args: argparse.Namespace, model: str, repeats: int):  # type: ignore[no-untyped-def]
    """The figure ``rollout/engine_vs_generate``: see the module docstring."""
    print(f"engine vs model.generate: {args.batch} prompts x {args.max_tokens} tokens, one process ...", flush=True)
    worker = Worker(args, "versus", model, args.max_tokens)
    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    try:
        for k in range(repeats):
            for side in ordered(["engine", "generate"], k):
                rates[side].append(worker.run(side=side)["rate"])
    finally:
        worker.close()
    ratios = [e / g for e, g in zip(rates["engine"], rates["generate"], strict=True)]
    print(f"  engine {statistics.median(rates['engine']):9.1f} tok/s, model.generate "
          f"{statistics.median(rates['generate']):9.1f} tok/s (medians)", flush=True)  # fmt: skip
    return figure(
        f"rollout/engine_vs_generate{size_suffix(args)}",
        ratios,
        goal=1.0,
        direction="min",
        baseline=f"HF model.generate on the same batch ({args.batch} prompts, {args.max_tokens} new tokens, "
        "do_sample, temperature 1, no top-k/top-p), same process",
    )


def grpc_vs_inprocess(args: argparse.Namespace, model: str, repeats: int, tmp: Path):  # type: ignore[no-untyped-def]
    """The figures ``rollout/grpc_vs_inprocess_<c>clients``: see the module docstring."""
    from rollout_server.launch import spawn_server
    from tether.redis_server import free_port

    max_tokens = args.max_tokens
    print("starting the rollout server process and the two load processes ...", flush=True)
    metrics_port = free_port()
    server = spawn_server([*overrides(model, args.engine, max_tokens), "--rollout.metrics_port", str(metrics_port)],
                          port=free_port(), log_path=tmp / "server.log", wait_s=600)  # fmt: skip
    workers: dict[str, Worker] = {}
    rows, turn = [], 0
    try:
        workers["local"] = Worker(args, "local", model, max_tokens)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        workers["remote"] = Worker(args, "remote", model, max_tokens, server.address, metrics_url)
        for c in CONCURRENCY:
            n_requests = max(2 * c, 8) if args.quick else max(args.requests_per_client * c, 32)
            answers: dict[str, list[dict]] = {"local": [], "remote": []}
            for _ in range(repeats):
                for side in ordered(["local", "remote"], turn):
                    answers[side].append(workers[side].run(n=n_requests, c=c))
                turn += 1
            rates = {side: [a["rate"] for a in got] for side, got in answers.items()}
            rows.append((c, n_requests, rates))
            print(f"  {c:>3} clients: in-process {statistics.median(rates['local']):9.1f} tok/s, "
                  f"gRPC {statistics.median(rates['remote']):9.1f} tok/s (medians)", flush=True)  # fmt: skip
            # Not timings: what the engine ran on each side, so a gap can be told from batching or from overhead.
            for side, name in (("local", "in-process"), ("remote", "gRPC")):
                print(f"       {name:>10}: {batch_shape(answers[side])}", flush=True)
    finally:
        for w in workers.values():
            w.close()
        server.terminate()

    print()
    print("| clients | requests | in-process tok/s | gRPC tok/s | ratio gRPC/in-process |")
    print("|--------:|---------:|-----------------:|-----------:|----------------------:|")
    figures = []
    for c, n, rates in rows:
        ratios = [r / loc for r, loc in zip(rates["remote"], rates["local"], strict=True)]
        fig = figure(
            f"rollout/grpc_vs_inprocess_{c}clients{size_suffix(args)}",
            ratios,
            goal=0.95,
            direction="min",
            baseline=f"the same {args.engine} engine called in-process by its own load process; {c} clients, "
            f"{max_tokens} tokens/request",
        )
        figures.append(fig)
        local, remote = statistics.median(rates["local"]), statistics.median(rates["remote"])
        print(f"| {c:>7} | {n:>8} | {local:>16.1f} | {remote:>10.1f} | {fig.ratio:>21.3f} |")
    return figures


if __name__ == "__main__":
    sys.exit(main())
