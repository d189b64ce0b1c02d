"""No code path of the project can deserialise data into code: a static check of every module.

tether's processes exchange data with each other and with user code over Redis, gRPC and files; any
of those can hold bytes an attacker (or a bug) wrote. Protobuf, safetensors and JSON carry data only;
pickle and its relatives run code while loading. So the project's sources (tether/, buffer/, learner/,
rollout_server/, weight_sync/, examples/) may not import pickle, cPickle, dill, cloudpickle, joblib,
marshal or shelve; may not call eval or exec; may not call torch.load without ``weights_only=True``
or numpy.load with ``allow_pickle=True``; and may not use torch.distributed's object collectives
(broadcast_object_list, gather_object, ...), which pickle under the hood. Parsed with ``ast``, so a
mention in a comment or a string is not a hit. Nothing is allow-listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tether", "buffer", "learner", "rollout_server", "weight_sync", "examples")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
BANNED_CALLS = {"eval", "exec"}
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "gather_object",
    "all_gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def sources() -> list[Path]:
    # Generated protobuf modules are plain data descriptors; they are checked like everything else.
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def violations(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in BANNED_MODULES:
                found.append((node.lineno, f"from {node.module} import ..."))
            found += [(node.lineno, f"import of {a.name}") for a in node.names if a.name in OBJECT_COLLECTIVES]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if isinstance(func, ast.Name) and name in BANNED_CALLS:
                found.append((node.lineno, f"{name}()"))
            if name in OBJECT_COLLECTIVES:
                found.append((node.lineno, f"{name}() pickles its objects"))
            if name == "load" and owner == "torch" and not _keyword_is(node, "weights_only", True):
                found.append((node.lineno, "torch.load without weights_only=True"))
            if name == "load" and owner in ("np", "numpy") and _keyword_is(node, "allow_pickle", True):
                found.append((node.lineno, "numpy.load(allow_pickle=True)"))
            if name == "read_pickle":
                found.append((node.lineno, "read_pickle()"))
        elif isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, f"reference to {node.attr}"))
    return sorted(set(found))


def test_the_check_sees_what_it_should() -> None:
    """The detector itself, on code that does each banned thing (and on harmless look-alikes)."""
    bad = """
import pickle
import cloudpickle as cp
from dill import loads
from torch.distributed import broadcast_object_list
import torch, numpy as np
eval(x)
exec(y)
torch.load(f)
torch.load(f, weights_only=False)
np.load(f, allow_pickle=True)
torch.distributed.all_gather_object(out, obj)
"""
    hits = {msg for _, msg in violations(ast.parse(bad))}
    assert {"import pickle", "import cloudpickle", "from dill import ...", "eval()", "exec()"} <= hits
    assert {"torch.load without weights_only=True", "numpy.load(allow_pickle=True)"} <= hits
    assert "import of broadcast_object_list" in hits and "all_gather_object() pickles its objects" in hits
    ok = """
import json
torch.load(f, weights_only=True)
np.load(f)
model.eval()
s = "import pickle"  # import pickle
"""
    assert violations(ast.parse(ok)) == []


def test_sources_found() -> None:
    names = {p.relative_to(ROOT).parts[0] for p in sources()}
    assert names == set(PACKAGES)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unsafe_deserialisation(path: Path) -> None:
    found = violations(ast.parse(path.read_text(), filename=str(path)))
    assert not found, "\n".join(f"{path.relative_to(ROOT)}:{line}: {msg}" for line, msg in found)
