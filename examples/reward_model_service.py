"""A reward model behind the Reward service: a sequence-classification model scores prompt + completion,
with requests from every caller batched together by token budget.

    python examples/reward_model_service.py --make-tiny /tmp/tiny-rm          # a tiny one, made locally
    python examples/reward_model_service.py --model /tmp/tiny-rm --port 50071 [--token TOKEN]

Every completion of every call goes into one queue; a loop takes what is waiting (waiting at most
``--batch-wait-ms`` for more) and runs one forward over as many as fit in
``--forward-max-token-len-per-gpu`` padded tokens (verl's name for the reward model's token budget, which
may be larger than the actor's), so 16 rollout servers each sending a group are scored in a few forwards,
not 16 × n. ``--no-batching`` scores each completion in a forward of its own (the baseline of
``bench/reward_model.py``). The reward is the model's scalar output (``num_labels=1``), also reported as
the component ``rm_score``. The model must be a decoder (causal) classifier with a ``score`` head, as
Qwen-, Llama- and Mistral-based reward models are: rows are right-padded and read at their last token.

Point rollout servers at it with ``rollout.reward: {type: remote, address: host:50071}``, or route some
data sources to it with ``{type: data_source, scorers: {my_source: remote}, remote: {address: ...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Runs from a checkout without installing: make the repo's `tether` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.prompts import encode_continuation, encode_prompt
from tether.reward_service import RewardService, serve
from tether.v1 import reward_pb2


def make_tiny_reward_model(out_dir: str | Path, *, hidden: int = 128, layers: int = 2, seed: int = 0) -> Path:
    """A Qwen2-style sequence-classification model (one output) with tether's byte-level tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tether.commands.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    out = Path(out_dir)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


PAD_LIMIT = 1.25
"""Most padded tokens per real token in one forward."""


@dataclass
class _Item:
    ids: list[int]
    done: asyncio.Future


class RewardModel(RewardService):
    def __init__(self, model_dir: str, *, max_batch_tokens: int = 16384, batch_wait_ms: float = 5.0,
                 batching: bool = True, max_length: int = 4096, device: str = "auto") -> None:  # fmt: skip
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)  # fmt: skip
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.pad = self.tokenizer.pad_token_id
        self.max_batch_tokens, self.batch_wait_s = max_batch_tokens, batch_wait_ms / 1000
        self.batching, self.max_length = batching, max_length
        self.queue: asyncio.Queue[_Item] | None = None
        self._batcher_task: asyncio.Task | None = None
        self.forwards = 0

    def _ids(self, req: reward_pb2.ScoreRequest) -> list[int]:
        # The prompt as the policy's servers encode one (BOS where the tokenizer adds it); the completion continues it.
        prompt = list(req.prompt_token_ids) or encode_prompt(self.tokenizer, req.prompt)
        completion = list(req.completion_token_ids) or encode_continuation(self.tokenizer, req.completion)
        ids = [*prompt, *completion][-self.max_length :]  # the end of a long sequence is what is judged
        if not ids:
            raise ValueError("empty prompt and completion")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids outside the reward model's vocabulary [0, {vocab})")
        return ids

    async def score_batch(self, reqs):
        if self.queue is None:  # on the server's event loop, at the first call
            self.queue = asyncio.Queue()
            self._batcher_task = asyncio.get_running_loop().create_task(self._batcher())
        loop = asyncio.get_running_loop()
        items = [_Item(self._ids(r), loop.create_future()) for r in reqs]  # bad input fails before queueing
        for item in items:
            self.queue.put_nowait(item)
        scores = await asyncio.gather(*(item.done for item in items))
        return [(s, {"rm_score": s}) for s in scores]

    async def score(self, req):
        return (await self.score_batch([req]))[0]

    async def _batcher(self) -> None:
        assert self.queue is not None
        waiting: list[_Item] = []
        while True:
            if not waiting:
                waiting.append(await self.queue.get())
                if self.batching:
                    await asyncio.sleep(self.batch_wait_s)  # let the other callers' completions arrive
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            batch = self._take(waiting)
            try:
                scores = await asyncio.to_thread(self._forward, [x.ids for x in batch])
            except Exception as e:  # the model failed: every caller of this batch hears it
                for x in batch:
                    if not x.done.done():  # a caller past its deadline has gone
                        x.done.set_exception(RuntimeError(f"reward model forward failed: {e!r}"))
                continue
            for x, s in zip(batch, scores, strict=True):
                if not x.done.done():
                    x.done.set_result(s)

    def _take(self, waiting: list[_Item]) -> list[_Item]:
        """The next forward's completions: the oldest first, then of what is waiting those closest to it in
        length, as long as the padded batch stays within the token budget and wastes at most a quarter of
        it on padding (a padded row costs its full width in attention)."""
        if not self.batching:
            return [waiting.pop(0)]
        anchor = len(waiting[0].ids)
        order = sorted(range(len(waiting)), key=lambda i: (abs(len(waiting[i].ids) - anchor), i))
        chosen: list[int] = []
        real, longest = 0, 0
        for i in order:
            n = len(waiting[i].ids)
            width = max(longest, n)
            if chosen and (width * (len(chosen) + 1) > self.max_batch_tokens
                           or width * (len(chosen) + 1) > PAD_LIMIT * (real + n)):  # fmt: skip
                continue
            chosen.append(i)
            real, longest = real + n, width
        batch = [waiting[i] for i in sorted(chosen)]
        for i in sorted(chosen, reverse=True):
            del waiting[i]
        return batch

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        torch = self.torch
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        last = torch.tensor([len(s) - 1 for s in seqs])
        with torch.inference_mode():
            # Right padding in a causal model: no real token attends to a pad after it, so no attention mask
            # is needed (and attention keeps its fast causal kernel); the score head reads each row's last
            # real token — what the model's own pooling does, without guessing it from the pad id.
            hidden = self.model.base_model(input_ids=ids.to(self.device)).last_hidden_state
            scores = self.model.score(hidden[torch.arange(len(seqs), device=self.device), last.to(self.device)])
        self.forwards += 1
        return scores[:, 0].float().tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-tiny", metavar="DIR", help="write a tiny sequence-classification model to DIR and exit")
    p.add_argument("--model", help="folder of a Hugging Face sequence-classification model (num_labels=1)")
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--host", default="0.0.0.0", help="bind address (default all interfaces)")
    p.add_argument("--token", default=os.environ.get("TETHER_AUTH_TOKEN", ""), help="required bearer token")
    p.add_argument("--forward-max-token-len-per-gpu", type=int, default=16384, help="padded tokens per forward")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a forward waits for more callers")
    p.add_argument("--no-batching", action="store_true", help="one completion per forward (a baseline)")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    args = p.parse_args(argv)
    if args.make_tiny:
        print(f"tiny reward model written to {make_tiny_reward_model(args.make_tiny)}")
        return 0
    if not args.model:
        p.error("give --model DIR (or --make-tiny DIR to make one)")
    service = RewardModel(
        args.model, max_batch_tokens=args.forward_max_token_len_per_gpu, batch_wait_ms=args.batch_wait_ms,
        batching=not args.no_batching, device=args.device,
    )  # fmt: skip
    serve(service, port=args.port, host=args.host, token=args.token)
    print(f"reward model service stopped after {service.forwards} forwards", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
