"""Datasets users bring: verl's parquet layout as is, ``datasets`` folders and local files, chat templates,
the prompt-length rule, and an exact resume position across row groups and epochs."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from learner.data import PromptSource
from learner.evaluation import load_val_prompts
from tether.config import TetherConfig
from tether.prompts import encode_prompt

QUESTIONS = [f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?" for i in range(10)]


def verl_rows(n: int = 10) -> list[dict]:
    """Rows exactly as verl's examples/data_preprocess/gsm8k.py writes them (the source alternates)."""
    return [
        {
            "data_source": "openai/gsm8k" if i % 2 == 0 else "lighteval/MATH",
            "prompt": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 3)},
            "extra_info": {"split": "train", "index": i, "answer": f"... #### {2 * i + 3}"},
        }
        for i in range(n)
    ]


def write_verl_parquet(path: Path, rows: list[dict], *, row_group_size: int = 3) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _cfg(model: Path, **learner) -> TetherConfig:
    return TetherConfig.model_validate({"model": {"path": str(model)}, "learner": learner,
                                        "rollout": {"reward": {"type": "data_source"}}})  # fmt: skip


def _render(model: Path, content: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def test_verl_parquet_rows_become_chat_prompts_with_answer_and_source(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = verl_rows()
    src = PromptSource(_cfg(tiny_model_dir, data_path=str(write_verl_parquet(tmp_path / "train.parquet", rows))))
    got = list(itertools.islice(src, 12))
    assert [p.text for p in got] == [_render(tiny_model_dir, QUESTIONS[i % 10]) for i in range(12)]
    assert got[0].text.endswith("<|im_start|>assistant\n")  # the generation prompt
    ctx = dict(got[3].reward_context)
    assert ctx["answer"] == "9" and ctx["data_source"] == "lighteval/MATH" and ctx["ability"] == "math"
    assert json.loads(ctx["reward_model"]) == {"style": "rule", "ground_truth": "9"}
    assert json.loads(ctx["extra_info"])["index"] == 3
    assert [p.dataset_index for p in got] == list(range(12)) and src.position == 12
    assert not got[0].token_ids  # no length limit: the server tokenizes the text


@pytest.mark.parametrize("start", [0, 2, 3, 7, 10, 14, 29])
def test_parquet_resume_is_exact_across_row_groups_and_epochs(tmp_path: Path, tiny_model_dir: Path, start) -> None:
    path = write_verl_parquet(tmp_path / "t.parquet", verl_rows(), row_group_size=3)
    cfg = _cfg(tiny_model_dir, data_path=str(path))
    full = list(itertools.islice(PromptSource(cfg), 35))
    resumed = PromptSource(cfg, start=start)
    assert list(itertools.islice(resumed, 35 - start)) == full[start:]
    assert resumed.position == 35
    assert PromptSource(cfg, start=99).prompts_at([31, 4, 14, 4]) == [full[4], full[14], full[31]]


def test_datasets_folder_and_local_files_read_like_parquet(tmp_path: Path, tiny_model_dir: Path) -> None:
    import datasets

    rows = verl_rows(6)
    parquet = list(itertools.islice(PromptSource(_cfg(tiny_model_dir, data_path=str(
        write_verl_parquet(tmp_path / "t.parquet", rows)))), 8))  # fmt: skip
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "dict")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for folder in ("saved", "dict", "files"):
        src = PromptSource(_cfg(tiny_model_dir, data_path=str(tmp_path / folder)), start=1)
        assert list(itertools.islice(src, 7)) == parquet[1:], folder
    jsonl = PromptSource(_cfg(tiny_model_dir, data_path=str(tmp_path / "files" / "train.jsonl")))
    assert list(itertools.islice(jsonl, 8)) == parquet


def test_columns_are_mapped_by_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "meta": {"gold": i}, "src": "gsm8k"}) + "\n"
                            for i in range(3)))  # fmt: skip
    cfg = _cfg(
        tiny_model_dir, data_path=str(path), prompt_key="question", answer_key="meta.gold", data_source_key="src"
    )
    p = next(PromptSource(cfg))
    assert p.text == "q0"  # a plain string stays as it is
    assert dict(p.reward_context) == {"meta": '{"gold": 0}', "src": "gsm8k", "answer": "0", "data_source": "gsm8k"}
    with pytest.raises(ValueError, match=r"has no column 'prompt' \(columns: meta, question, src\)"):
        PromptSource(_cfg(tiny_model_dir, data_path=str(path), data_source_key="src"))


def test_overlong_prompts_fail_filter_or_truncate(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    rows = [{"prompt": "x" * n, "data_source": "gsm8k", "answer": "1"} for n in (5, 50, 8, 60, 3)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 1 of .* is 50 tokens, over the prompt limit of 10 \(learner.max_pro"):
        PromptSource(_cfg(tiny_model_dir, data_path=str(path), max_prompt_length=10))
    src = PromptSource(_cfg(tiny_model_dir, data_path=str(path), max_prompt_length=10, filter_overlong_prompts=True))
    assert src.filtered == 2
    got = list(itertools.islice(src, 4))
    assert [len(p.text) for p in got] == [5, 8, 3, 5] and [p.dataset_index for p in got] == [0, 2, 4, 5]
    assert src.position == 6  # the filtered row 6 (= row 1) is not pulled yet
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows[1]["prompt"] = "".join(chr(ord("a") + i % 26) for i in range(50))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for side in ("left", "right"):
        src = PromptSource(_cfg(tiny_model_dir, data_path=str(path), max_prompt_length=10, truncation=side))
        assert src.overlong == 2 and src.filtered == 0
        p = list(itertools.islice(src, 2))[1]
        ids = encode_prompt(tok, rows[1]["prompt"])  # as servers encode it (the tiny tokenizer adds no BOS)
        assert list(p.token_ids) == (ids[-10:] if side == "left" else ids[:10])


def test_the_prompt_limit_follows_rollout_max_prompt_len_and_names_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With ``learner.max_prompt_length`` empty the learner checks the servers' limit at start, so a dataset the
    servers would refuse row by row fails before anything is issued, naming the row and the setting."""
    rows = verl_rows()
    rows[3]["prompt"] = [{"role": "user", "content": "y" * 150}]  # 169 tokens with the template; the rest < 90
    path = write_verl_parquet(tmp_path / "train.parquet", rows)
    rollout = {"reward": {"type": "data_source"}, "max_prompt_len": 120}
    cfg = TetherConfig.model_validate({"model": {"path": str(tiny_model_dir)}, "learner": {"data_path": str(path)},
                                       "rollout": rollout})  # fmt: skip
    with pytest.raises(ValueError, match=r"row 3 of .* is 1\d\d tokens, over the prompt limit of 120 "
                                         r"\(rollout.max_prompt_len; learner.max_prompt_length follows it\) — "
                                         r"raise rollout.max_prompt_len"):  # fmt: skip
        PromptSource(cfg)
    filtering = cfg.learner.model_copy(update={"filter_overlong_prompts": True})
    src = PromptSource(cfg.model_copy(update={"learner": filtering}))
    assert src.filtered == 1  # counted, the rest issued as they are
    assert [p.dataset_index for p in itertools.islice(src, 4)] == [0, 1, 2, 4]


def test_the_prompt_limit_is_capped_by_the_model_context_as_servers_do(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Servers refuse prompts over ``min(rollout.max_prompt_len, max_model_len - 1)``: so does the learner."""
    from learner.rows import RowFormat

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 40, "answer": "1", "data_source": "gsm8k"}) + "\n")
    cfg = TetherConfig.model_validate({"model": {"path": str(tiny_model_dir), "max_model_len": 32},
                                       "learner": {"data_path": str(path)}})  # fmt: skip
    assert RowFormat(cfg, what="learner.data_path").max_len == 31
    with pytest.raises(ValueError, match=r"is 40 tokens, over the prompt limit of 31 \(the model's context of 32 "
                                         r"tokens \(model.max_model_len\) less one\)"):  # fmt: skip
        PromptSource(cfg)
    default = TetherConfig.model_validate({"model": {"path": str(tiny_model_dir)}, "learner": {"data_path": str(path)}})
    assert RowFormat(default, what="learner.data_path").limit[:2] == (1024, "rollout.max_prompt_len")


def test_chat_prompts_without_a_chat_template_fail_clearly(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_verl_parquet(tmp_path / "t.parquet", verl_rows(2))
    with pytest.raises(ValueError, match=r"row 0: the prompt is chat messages but the tokenizer of .* has no chat"):
        next(PromptSource(_cfg(model, data_path=str(path))))


def test_a_data_source_without_a_scorer_fails_at_start_naming_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = verl_rows(4)
    rows[3]["data_source"] = "my_lab/proofs"
    path = write_verl_parquet(tmp_path / "t.parquet", rows)
    with pytest.raises(ValueError, match=r"^learner.data_path: no scorer for data_source 'my_lab/proofs'"):
        PromptSource(_cfg(tiny_model_dir, data_path=str(path)))
    with pytest.raises(ValueError, match=r"^learner.val_data_path: no scorer for data_source 'my_lab/proofs'"):
        load_val_prompts(_cfg(tiny_model_dir, val_data_path=str(path)))
    reward = {"type": "data_source", "scorers": {"my_lab/proofs": "exact_match"}}
    routed = TetherConfig.model_validate(
        {"model": {"path": str(tiny_model_dir)}, "learner": {"data_path": str(path)}, "rollout": {"reward": reward}}
    )
    assert next(PromptSource(routed)).reward_context["data_source"] == "openai/gsm8k"


def test_evaluation_set_from_parquet_keeps_sources(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_verl_parquet(tmp_path / "val.parquet", verl_rows(5))
    prompts = load_val_prompts(_cfg(tiny_model_dir, val_data_path=str(path), val_max_prompts=4))
    assert [p.dataset_index for p in prompts] == [0, 1, 2, 3]
    assert [p.reward_context["data_source"] for p in prompts] == ["openai/gsm8k", "lighteval/MATH"] * 2


def test_tether_up_refuses_a_source_without_a_scorer_before_starting(tmp_path: Path, tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    rows = verl_rows(4)
    rows[2]["data_source"] = "my_lab/proofs"
    path = write_verl_parquet(tmp_path / "t.parquet", rows)
    args = ["--model.path", str(tiny_model_dir), "--learner.data_path", str(path), "--run.output_dir", str(tmp_path),
            "--rollout.reward", "{type: data_source}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tether", "up", *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tether: config error: learner.data_path: no scorer for data_source 'my_lab/proofs'" in proc.stderr
    assert not list(tmp_path.glob("*/logs"))  # nothing was started
