"""One way to encode a prompt (issue #43): a raw string gets the tokenizer's own BOS once, chat messages their
template's, no prompt ends in EOS, and the learner's rows, the servers' checks, the length scan and a multi-turn
episode all produce the same ids.

No hub: each family's tokenizer is built here with its real class and the special-token settings of its released
``tokenizer.json`` / ``tokenizer_config.json`` — Gemma (``GemmaTokenizer``, ``add_bos_token``), Llama 3
(``PreTrainedTokenizerFast`` whose TemplateProcessing post-processor adds ``<|begin_of_text|>`` while
``add_bos_token`` reads False), Qwen2 (``Qwen2TokenizerFast``, no BOS) — saved and loaded back through
``AutoTokenizer`` as a model folder is, with tether's byte-level tiny tokenizer beside them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from learner.rows import RowFormat
from rollout_server.validation import encode, prompt_ids
from tests.helpers import scripted_engine
from tether.client import generate_request, open_episode_request
from tether.config import TetherConfig
from tether.prompts import count_prompt_tokens, encode_chat, encode_continuation, encode_prompt, prompt_prefix

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = "Hello world: what is 12 + 30?"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 + 30?"}]


def _specials(names: tuple[str, ...]) -> list[AddedToken]:
    return [AddedToken(t, special=True, normalized=False) for t in names]


def gemma(*, add_eos_token: bool = False) -> Any:
    """Gemma's layout: BPE with byte fallback, ``<bos>`` = 2 added by the tokenizer, turn markers as specials."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<start_of_turn>": 5, "<end_of_turn>": 6}
    vocab.update({f"<0x{b:02X}>": 7 + b for b in range(256)})
    for piece in ("▁", "H", "e", "l", "o", "He", "ll", "Hell", "Hello"):
        vocab.setdefault(piece, len(vocab))
    merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o")]
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=add_eos_token)
    tok.add_tokens(_specials(("<start_of_turn>", "<end_of_turn>")))
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def _byte_level_vocab() -> dict[str, int]:
    return {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}


def llama3() -> Any:
    """Llama 3's layout: a byte-level BPE whose post-processor (not ``add_bos_token``) adds ``<|begin_of_text|>``."""
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(vocab=_byte_level_vocab(), merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>"])  # fmt: skip
    bos = ("<|begin_of_text|>", t.token_to_id("<|begin_of_text|>"))
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[bos],
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B:1"),
    ])  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def qwen2() -> Any:
    """Qwen2's layout: byte-level BPE, no BOS, ChatML specials."""
    from transformers import Qwen2TokenizerFast

    tok = Qwen2TokenizerFast(vocab=_byte_level_vocab(), merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens(_specials(("<|endoftext|>", "<|im_start|>", "<|im_end|>")))
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny() -> Any:
    from tether.commands.tiny_model import build_tokenizer

    return build_tokenizer()


FAMILIES: dict[str, tuple[Callable[[], Any], str | None]] = {
    "gemma": (gemma, "<bos>"),
    "gemma-add-eos": (lambda: gemma(add_eos_token=True), "<bos>"),
    "llama3": (llama3, "<|begin_of_text|>"),
    "qwen2": (qwen2, None),
    "tiny": (tiny, None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tokenizer saved as a model folder's tokenizer is (what ``model.path`` names)."""
    out = {}
    for name, (build, _) in FAMILIES.items():
        out[name] = tmp_path_factory.mktemp(name)
        build().save_pretrained(out[name])
    return out


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest, folders: dict[str, Path]) -> Iterator[tuple[str, Path, Any, int | None]]:
    """(name, folder, the tokenizer loaded back from it, its BOS id or None)."""
    from transformers import AutoTokenizer

    name = request.param
    tok = AutoTokenizer.from_pretrained(folders[name])
    bos = FAMILIES[name][1]
    yield name, folders[name], tok, (tok.convert_tokens_to_ids(bos) if bos else None)


def test_the_prefix_is_what_the_tokenizer_itself_puts_before_the_text(family) -> None:
    name, _, tok, bos = family
    assert prompt_prefix(tok) == ((bos,) if bos is not None else ())
    assert prompt_prefix(tok) is prompt_prefix(tok)  # worked out once per tokenizer
    plain = tok(TEXT, add_special_tokens=False)["input_ids"]
    hf = tok(TEXT)["input_ids"]
    assert hf[: len(hf) - (name == "gemma-add-eos")] == encode_prompt(tok, TEXT)  # HF's own, less a trailing EOS
    if name == "tiny":  # the tiny models' ids stay exactly the bytes
        assert encode_prompt(tok, TEXT) == plain == list(TEXT.encode())


def test_a_raw_string_gets_bos_exactly_once_and_never_eos(family) -> None:
    name, _, tok, bos = family
    ids = encode_prompt(tok, TEXT)
    plain = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == ([bos] if bos is not None else []) + plain
    if bos is not None:
        assert ids.count(bos) == 1
        assert encode_prompt(tok, tok.bos_token + TEXT) == ids  # already spelled: not doubled
    if name == "gemma-add-eos":
        assert tok(TEXT)["input_ids"][-1] == tok.eos_token_id  # the tokenizer would append it ...
    assert ids[-1] != tok.eos_token_id  # ... a prompt never ends in it


def test_chat_messages_get_the_templates_bos_once(family) -> None:
    _, _, tok, bos = family
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = encode_chat(tok, MESSAGES)
    assert ids == encode_prompt(tok, rendered)
    if bos is not None:
        assert rendered.startswith(tok.bos_token)  # the template spells it ...
        assert ids[0] == bos and ids.count(bos) == 1  # ... and it is not added again
        assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    else:
        assert ids == tok(rendered)["input_ids"]


def test_the_learner_the_servers_and_the_length_scan_agree(family) -> None:
    """The same prompt, raw or as chat messages, through the learner's rows (ids and the length scan), the
    servers' request check and the prompt worker's encode: one list of ids."""
    _, folder, tok, bos = family
    fmt = RowFormat(TetherConfig.model_validate({"model": {"path": str(folder)}}), what="learner.data_path")
    rollout = TetherConfig.model_validate({}).rollout
    vocab = len(tok)
    texts = [fmt.text({"prompt": TEXT}, 0), fmt.text({"prompt": MESSAGES}, 1)]
    assert texts[1] == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    learner_ids = [fmt.ids(t) for t in texts]
    server_ids = [
        prompt_ids(generate_request(text=TEXT), tok, rollout, vocab_size=vocab, max_model_len=4096),
        prompt_ids(generate_request(messages=MESSAGES), tok, rollout, vocab_size=vocab, max_model_len=4096),
    ]
    assert learner_ids == server_ids == [encode_prompt(tok, TEXT), encode_chat(tok, MESSAGES)]
    assert [encode(tok, t) for t in texts] == learner_ids  # the prompt worker encodes the Prompt's text so
    spelled = (tok.bos_token or "") + TEXT
    assert fmt.lengths([*texts, spelled]) == [len(x) for x in learner_ids] + [len(encode_prompt(tok, spelled))]
    assert count_prompt_tokens(tok, texts) == fmt.lengths(texts)
    if bos is not None:
        assert all(x.count(bos) == 1 for x in learner_ids)


def test_left_truncation_keeps_the_bos(folders: dict[str, Path]) -> None:
    """An overlong prompt cut from the left loses its oldest text, not the BOS the model expects first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["gemma"])
    full = encode_prompt(tok, TEXT)
    for side, want in (("left", [full[0], *full[-7:]]), ("right", full[:8])):
        cfg = TetherConfig.model_validate({"model": {"path": str(folders["gemma"]), "max_model_len": 4096},
                                           "learner": {"max_prompt_length": 8, "truncation": side}})  # fmt: skip
        prompt = RowFormat(cfg, what="learner.data_path").prompt({"prompt": TEXT}, 0, prompt_id="p")
        assert list(prompt.token_ids) == want
        assert prompt.token_ids[0] == tok.bos_token_id


@pytest.mark.parametrize("kind", ["text", "messages"])
async def test_an_episode_has_one_bos_at_its_start_and_none_in_the_middle(kind: str, redis_url: str) -> None:
    """Gemma's multi-turn episode: the opening prompt is a prompt (one ``<bos>``), every observation continues it;
    the ids the engine sees at each turn are the record so far, and the ``<end_of_turn>`` Gemma stops on is not
    written twice when the template closes the turn."""
    from rollout_server.episodes import EpisodeStore
    from rollout_server.metrics import ServerMetrics
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState
    from tether.v1 import rollout_pb2

    tok = gemma()
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    engine = scripted_engine(tok, [[*encode_continuation(tok, "42"), end_of_turn]])
    cfg = TetherConfig.model_validate({"run": {"run_id": "prompts"}, "buffer": {"redis_url": redis_url}})
    sink = BufferSink(cfg, "s")
    try:
        store = EpisodeStore(ServerState(cfg=cfg, engine=engine, server_id="s", metrics=ServerMetrics("s"), sink=sink))
        opening = {"text": TEXT} if kind == "text" else {"messages": MESSAGES[1:]}
        opened = await store.open(open_episode_request(**opening))
        first = encode_prompt(tok, TEXT) if kind == "text" else encode_chat(tok, MESSAGES[1:])
        assert list(opened.prompt_token_ids) == first and first.count(tok.bos_token_id) == 1
        await store.step(rollout_pb2.StepRequest(episode_id=opened.episode_id))
        await store.step(rollout_pb2.StepRequest(episode_id=opened.episode_id, observation="Hello again"))
        assert engine.seen[0] == first
        context = engine.seen[1]
        assert context[: len(first) + len(engine.replies[0])] == first + engine.replies[0]
        assert context.count(tok.bos_token_id) == 1 and context[0] == tok.bos_token_id
        observation = context[len(first) + len(engine.replies[0]) :]
        if kind == "text":
            assert observation == encode_continuation(tok, "Hello again")
        else:  # the template's close of the model's turn (less the <end_of_turn> it stopped on), the new turn
            assert observation == encode_continuation(
                tok, "\n<start_of_turn>user\nHello again<end_of_turn>\n<start_of_turn>model\n"
            )
            rendered = tok.apply_chat_template([*MESSAGES[1:], {"role": "assistant", "content": "42"},
                                                {"role": "user", "content": "Hello again"}],
                                               tokenize=False, add_generation_prompt=True)  # fmt: skip
            assert context == encode_prompt(tok, rendered)  # exactly the whole conversation, rendered once
    finally:
        await asyncio.to_thread(sink.close)
