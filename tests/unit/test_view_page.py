"""The viewer's page from a small synthetic run folder: ids decoded with the run's tokenizer (found through
``model.path``, relative to the project too), the data embedded so that no completion can end the script
element, a page without a tokenizer that shows ids, and ``tether view`` writing the file or naming what is
wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tether.commands.cli import main
from tether.commands.viewer.page import build_page, run_data
from tether.commands.viewer.tokens import find_decoder
from tether.records import DEAD_LETTERS, GENERATIONS, GenerationsFile, NewestFile

HOSTILE = "</script><script>alert(1)</script>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.commands.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("project") / "tok"
    build_tokenizer().save_pretrained(out)
    return out


def _run(root: Path, tokenizer_dir: Path, *, model_path: str) -> Path:
    """``root/runs/r1`` with two logged steps and one dead letter, as the learner writes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    run = root / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": model_path}}))
    gen = GenerationsFile(run / GENERATIONS, max_bytes=1 << 20, every=1)
    for step, (prompt, completion, reward) in enumerate([("digits:", "123", 1.0), ("upper:", HOSTILE, 0.25)], 1):
        c = ids(completion)
        sample = {"ids": c, "v": step - 1, "lp": [-0.5] * len(c), "reward": reward, "finish": "stop", "adv": 0.5}
        gen.append(step, [{"version": step, "staleness": 1, "group_id": f"g{step}", "server": "rollout-0",
                           "data_source": "charclass", "context": {"answer": prompt[:-1]}, "prompt": ids(prompt),
                           "samples": [sample]}])  # fmt: skip
    NewestFile(run / DEAD_LETTERS, max_bytes=1 << 20).append(
        [{"id": "1-0", "step": 2, "reason": "g9: reward failed: boom", "origin": "rollout-0", "prompt": ids("lower:")}]
    )
    return run


def test_the_run_is_decoded_with_its_tokenizer(tmp_path: Path, tokenizer_dir: Path) -> None:
    run = _run(tmp_path, tokenizer_dir, model_path=str(tokenizer_dir))
    decoder, note = find_decoder(run)
    assert decoder is not None and str(tokenizer_dir) in note
    data = run_data(run, decoder=decoder, note=note)
    assert [g["prompt_text"] for g in data["groups"]] == ["digits:", "upper:"]
    assert data["dead"][0]["prompt_text"] == "lower:" and "prompt" not in data["groups"][0]
    pieces = data["pieces"]
    assert "".join(pieces[str(i)] for i in data["groups"][1]["samples"][0]["ids"]) == HOSTILE


def test_the_page_says_which_completion_lengths_were_not_trained(tmp_path: Path, tokenizer_dir: Path) -> None:
    run = _run(tmp_path, tokenizer_dir, model_path=str(tokenizer_dir))
    assert run_data(run, decoder=None)["lengths"] == ""  # no books yet
    (run / "buffer_stats.json").write_text(json.dumps({
        "buffer/length_tv": 0.084, "buffer/length_mean_generated": 14.04, "buffer/length_mean_trained": 8.69,
        "buffer/length_drop_rate/128-181": 1.0, "buffer/length_drop_rate/23-31": 0.25,
        "buffer/length_drop_rate/4-5": 0.0}, sort_keys=True))  # fmt: skip
    assert run_data(run, decoder=None)["lengths"] == (
        "lengths: TV(generated, trained) 0.084, mean 14.0 generated / 8.7 trained tokens, "
        "not trained: 23-31 tokens 25%, 128-181 tokens 100%"
    )


def test_a_relative_model_path_is_found_from_the_project(tmp_path: Path, tokenizer_dir: Path) -> None:
    project = tokenizer_dir.parent  # the run sits in <project>/runs/r1, model.path is relative to <project>
    decoder, _ = find_decoder(_run(project, tokenizer_dir, model_path="tok"))
    assert decoder is not None and decoder.text(decoder.tokenizer("abc")["input_ids"]) == "abc"


def test_the_page_embeds_the_data_without_letting_it_out(tmp_path: Path, tokenizer_dir: Path) -> None:
    run = _run(tmp_path, tokenizer_dir, model_path=str(tokenizer_dir))
    page = build_page(run)
    assert page.count("</script>") == 2 and HOSTILE not in page  # the data and the script elements only
    (raw,) = re.findall(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    data = json.loads(raw)
    assert data["run"] == "r1" and len(data["groups"]) == 2 and data["dead"][0]["reason"] == "g9: reward failed: boom"
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page  # nothing fetched


def test_a_run_that_logged_nothing_yet_has_a_page(tmp_path: Path, tokenizer_dir: Path) -> None:
    run = tmp_path / "runs" / "fresh"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(tokenizer_dir)}}))
    data = run_data(run, decoder=find_decoder(run)[0])
    assert (data["groups"], data["dead"], data["pieces"]) == ([], [], {})
    assert "No sampled groups yet" in build_page(run)


def test_without_a_tokenizer_the_page_shows_ids(tmp_path: Path, tokenizer_dir: Path) -> None:
    run = _run(tmp_path, tokenizer_dir, model_path=str(tmp_path / "gone"))
    decoder, note = find_decoder(run)
    assert decoder is None and "token ids shown" in note and "--tokenizer" in note
    data = run_data(run, decoder=None, note=note)
    assert data["groups"][0]["prompt_text"].replace(" ", "").isdigit()
    assert data["pieces"] == {}


def test_tether_view_writes_the_page_or_says_what_is_wrong(tmp_path: Path, tokenizer_dir: Path, capsys) -> None:
    run = _run(tmp_path, tokenizer_dir, model_path=str(tokenizer_dir))
    out = tmp_path / "out" / "page.html"
    assert main(["view", str(run), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>") and "wrote" in capsys.readouterr().out
    assert main(["view", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["view", str(tmp_path), "--out", str(out)]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert main(["view", str(run), "--port", "70000"]) == 2
    assert "not a port" in capsys.readouterr().err
