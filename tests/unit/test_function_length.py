"""No function of the product code is longer than 60 lines (issue 46): a longer one gets split into named helpers.

A function's length is what :mod:`ast` says it spans, ``end_lineno - lineno + 1``: its signature, docstring,
comments and nested functions included, its decorators not. Every function and method counts, nested ones
too (each on its own, and inside the one that holds it). The packages are the product's — ``tether``,
``buffer``, ``learner``, ``rollout_server``, ``weight_sync`` — less the generated protobuf modules of
``tether/v1``. Nothing is allow-listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tether", "buffer", "learner", "rollout_server", "weight_sync")
MAX_LINES = 60


def sources() -> list[Path]:
    return sorted(
        path
        for pkg in PACKAGES
        for path in (ROOT / pkg).rglob("*.py")
        if path.relative_to(ROOT).parts[:2] != ("tether", "v1")  # generated
    )


def long_functions(source: str, *, limit: int = MAX_LINES) -> list[str]:
    """``line N: name (L lines)`` for each function of ``source`` longer than ``limit`` lines, in order."""
    return [
        f"line {node.lineno}: {node.name} ({length} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := node.end_lineno - node.lineno + 1) > limit
    ]


def test_no_function_is_longer_than_60_lines():
    bad = [
        f"{path.relative_to(ROOT)}: {hit}"
        for path in sources()
        for hit in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not bad, f"functions over {MAX_LINES} lines (split them into named helpers):\n  " + "\n  ".join(bad)


def _function(lines: int, *, indent: str = "", is_async: bool = False) -> str:
    """A function spanning exactly ``lines`` lines (a docstring line, then statements)."""
    body = [f'{indent}    """Doc."""'] + [f"{indent}    x = {i}" for i in range(lines - 2)]
    return "\n".join([f"{indent}{'async ' if is_async else ''}def f():", *body]) + "\n"


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        (_function(60), False),
        (_function(61), True),
        (_function(61, is_async=True), True),
        ("class C:\n" + _function(61, indent="    "), True),
        ("@decorator\n" + _function(60), False),  # decorators do not count
        ("def outer():\n" + _function(59, indent="    "), False),  # 1 + 59 lines
        ("def outer():\n" + _function(60, indent="    "), True),  # the inner one is 60, the outer 61
    ],
)
def test_the_rule_can_fail(source, flagged):
    """The checker counts a function's lines as ast spans them and flags one over the limit, nothing else."""
    assert bool(long_functions(source)) is flagged
