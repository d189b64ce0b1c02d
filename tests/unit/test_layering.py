"""The import graph flows one way: commands → processes → libraries → the shared core (issue 16).

Layers, lowest first:

0. the shared core: ``tether`` (config, logging, metrics, generated protos, the trajectory type);
1. the libraries: ``buffer`` and ``weight_sync`` (each may use the core, never the other);
2. the processes: ``learner`` and ``rollout_server`` (libraries and core, never each other);
3. the operator's commands: ``tether.commands`` (the CLI, ``tether up``, status, console) and
   ``python -m tether`` (``tether.__main__``), which may use all.

The test reads every module's imports with :mod:`ast` (module level and inside functions alike), so a lazy
import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMANDS = "tether.commands"
ENTRY_POINTS = {"tether.__main__"}  # ``python -m tether`` is the CLI
LAYER = {"tether": 0, "buffer": 1, "weight_sync": 1, "learner": 2, "rollout_server": 2, COMMANDS: 3}


def _unit(module: str) -> str:
    """The layer unit a dotted module name belongs to (``tether.commands`` is its own unit)."""
    if module == COMMANDS or module.startswith(COMMANDS + ".") or module in ENTRY_POINTS:
        return COMMANDS
    return module.split(".")[0]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in ("tether", "buffer", "weight_sync", "learner", "rollout_server"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            if rel.parts[:2] == ("tether", "v1"):
                continue  # generated
            out.append((".".join(rel.parts), path))
    return out


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def against_layering(module: str, name: str) -> bool:
    """Whether ``module`` importing ``name`` goes up or sideways (same layer, other package)."""
    unit, other = _unit(module), _unit(name)
    return other in LAYER and other != unit and LAYER[other] >= LAYER[unit]


def upward_edges() -> list[str]:
    return [
        f"{module} imports {name}"
        for module, path in _modules()
        for name in sorted(_imports(path))
        if against_layering(module, name)
    ]


def test_imports_flow_one_way():
    bad = upward_edges()
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    ("module", "name", "upward"),
    [
        ("tether.config", "buffer.keys", True),
        ("buffer.reader", "weight_sync.sender", True),
        ("weight_sync.sender", "rollout_server.server", True),
        ("learner.main", "rollout_server.worker", True),
        ("learner.main", "tether.commands.launcher", True),
        ("tether.__main__", "tether.commands.cli", False),
        ("tether.runs", "tether.commands.status", True),
        ("tether.commands.cli", "rollout_server.main", False),
        ("learner.main", "buffer.reader", False),
    ],
)
def test_the_rule_can_fail(module, name, upward):
    """The checker flags an upward or sideways edge and passes a downward one."""
    assert against_layering(module, name) is upward
