"""The import graph flows one way: the command line → processes → libraries → the shared core (issues 16, 35).

Layers, lowest first; a module belongs to the longest module tree of :data:`LAYER` that holds it:

0. the shared core, ``tether``: what every process needs — config, contracts (the trajectory type, the
   generated protos, the run folder and its records), logging, metrics, spans and trackers, the embedded
   Redis, the scorers and tasks;
1. the libraries: ``buffer`` and ``weight_sync`` (each may use the core, never the other);
2. the processes: ``learner`` and ``rollout_server`` (libraries and core, never each other);
3. the command line, ``tether.commands`` with its entry point ``tether.__main__`` (``python -m tether``):
   the CLI, ``tether up`` and its supervisor, status, console, trace, the viewer's page, the planner, the
   tiny-model maker and the warm start. It may use all; nothing below imports it.

The test reads every module's imports with :mod:`ast` (module level and inside functions alike), so a lazy
import cannot hide an upward edge.

Weight sync in particular never reaches into an engine (issue 33): it never imports ``rollout_server``
(not even by a dotted name in a string) and has no variable, argument or attribute named ``engine`` or
``llm`` — it calls what it loads into through ``weight_sync.loading.WeightLoader`` and nothing else.

No module takes another's private names (issue 35): ``from X import _y`` with ``X`` another first-party
module means ``_y`` is shared, so it gets a public name in one home both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TREES = {
    "tether": "core",
    "buffer": "buffer",
    "weight_sync": "weight_sync",
    "learner": "learner",
    "rollout_server": "rollout_server",
    "tether.commands": "command line",
    "tether.__main__": "command line",
}
"""Each module tree and the unit it belongs to (the command line is two trees: its package and its entry)."""
LAYER = {"core": 0, "buffer": 1, "weight_sync": 1, "learner": 2, "rollout_server": 2, "command line": 3}


def _unit(module: str) -> str:
    """The unit of the longest tree of :data:`TREES` that holds a dotted module name, or its top-level
    package when none does (a third-party module)."""
    trees = [t for t in TREES if module == t or module.startswith(t + ".")]
    return TREES[max(trees, key=len)] if trees else module.split(".")[0]


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
        ("tether.redis_server", "tether.commands.supervisor", True),
        ("tether.records", "tether.commands.viewer.page", True),
        ("tether.commands.plan.sim", "tether.config", False),
        ("tether.runs", "tether.commands.status", True),
        ("tether.commands.cli", "rollout_server.main", False),
        ("learner.main", "buffer.reader", False),
    ],
)
def test_the_rule_can_fail(module, name, upward):
    """The checker flags an upward or sideways edge and passes a downward one."""
    assert against_layering(module, name) is upward


ENGINE_NAMES = {"engine", "llm"}
"""Identifiers weight_sync must not have: what it loads into is a ``WeightLoader``, not an engine it reads."""


def engine_reach(source: str) -> list[str]:
    """Where a module's source imports the rollout server or names an engine (line: what), in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(line, f"imports {m}") for m in modules if _unit(m) == "rollout_server"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.split(".")[0] == "rollout_server":
                found.append((line, f"names {node.value!r}"))
        else:
            names = {
                ast.Name: lambda n: n.id,
                ast.Attribute: lambda n: n.attr,
                ast.arg: lambda n: n.arg,
                ast.keyword: lambda n: n.arg,
            }
            get = names.get(type(node))
            name = get(node) if get is not None else None
            if name in ENGINE_NAMES:
                found.append((line, f"{type(node).__name__.lower()} {name!r}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_weight_sync_never_reaches_into_an_engine():
    bad = [
        f"{module}: {hit}"
        for module, path in _modules()
        if _unit(module) == "weight_sync"
        for hit in engine_reach(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "weight_sync must load through WeightLoader, never an engine:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    ("source", "reaches"),
    [
        ("from rollout_server.engines import Engine", True),
        ("import rollout_server.engines.vllm_engine as v", True),
        ("cls = 'rollout_server.engines.vllm_worker.WeightSyncWorker'", True),
        ("def f(engine):\n    return 1", True),
        ("self.engine = x", True),
        ("model = self.engine.model", True),
        ("await target.llm.collective_rpc('tether_prepare')", True),
        ("getattr(engine, 'model', None)", True),
        ("await loader.load_weights(named, version=1)", False),
        ("s = 'the rollout server and its engine'", False),
        ("class ModelEngine:\n    pass", False),
    ],
)
def test_the_engine_rule_can_fail(source, reaches):
    """The weight_sync check flags an import of the rollout server or any use of an engine, nothing else."""
    assert bool(engine_reach(source)) is reaches


def private_imports(module: str, source: str) -> list[str]:
    """The underscore names ``module`` imports from another first-party module (dunders are public)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module == module or _unit(node.module) not in LAYER:
            continue
        found += [
            f"line {node.lineno}: from {node.module} import {a.name}"
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")
        ]
    return found


def test_no_private_name_crosses_a_module():
    bad = [
        f"{module}: {hit}"
        for module, path in _modules()
        for hit in private_imports(module, path.read_text(encoding="utf-8"))
    ]
    assert not bad, "private names imported from another module (give them a public home):\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    ("module", "source", "private"),
    [
        ("tether.commands.console", "from tether.commands.status import _fmt, render_status", True),
        ("learner.main", "def f():\n    from buffer.writer import _coalesce", True),
        ("buffer.reader", "from weight_sync.receiver import _Stage", True),
        ("tether.commands.console", "from tether.commands.snapshot import fmt", False),
        ("tether.commands.cli", "from tether import __version__", False),
        ("buffer.reader", "from collections import _chain_map", False),
        ("buffer.reader", "from buffer.reader import _helper", False),
    ],
)
def test_the_private_rule_can_fail(module, source, private):
    """The check flags a single-underscore name taken from another first-party module, nothing else."""
    assert bool(private_imports(module, source)) is private


def _module_edges(source: str, known: set[str]) -> set[str]:
    """The first-party modules ``source`` imports (module level and inside functions; not under ``if
    TYPE_CHECKING:``, which never runs). ``from pkg import sub`` is an edge to ``pkg.sub`` when that is a module,
    else to ``pkg``; a package is its ``__init__``."""
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }

    def resolve(name: str) -> str | None:
        while name:
            if name in known:
                return name
            if f"{name}.__init__" in known:
                return f"{name}.__init__"
            name = name.rpartition(".")[0]
        return None

    edges = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [resolve(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
        else:
            continue
        edges.update(t for t in targets if t)
    return edges


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_two_files_import_each_other():
    """No import cycle between files, however long or lazy (a function-level import hides one, it does not
    remove it): two modules that need each other are one module, or share a third."""
    modules = dict(_modules())
    known = set(modules)
    graph = {m: _module_edges(p.read_text(encoding="utf-8"), known) - {m} for m, p in modules.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" ↔ ".join(c) for c in cycles)


def test_the_cycle_rule_can_fail():
    known = {"a", "b", "c", "pkg.__init__", "pkg.sub"}
    graph = {
        "a": _module_edges("import b", known),
        "b": _module_edges("def f():\n    from c import x", known),
        "c": _module_edges("from a import y", known),
        "pkg.__init__": _module_edges("def f():\n    from pkg.sub import z", known),
        "pkg.sub": _module_edges("from pkg import sub\nif TYPE_CHECKING:\n    import a", known),
    }
    assert graph["pkg.sub"] == {"pkg.sub"}  # the submodule itself, not its package; the type-only import skipped
    assert import_cycles(graph) == [["a", "b", "c"]]
