"""verl's numerics modules, imported without verl's package ``__init__`` (no ray, no plugin discovery).

``verl/__init__.py`` imports ray and runs entry-point plugin discovery; ``core_algos`` itself needs neither
(``verl.protocol``, which it reaches through ``rollout_corr_helper``, names ray at import time only). So
while importing, a meta-path finder serves stub modules for ``ray`` and ``ray.*``, and ``verl`` is a bare
package module whose ``__path__`` is the installed verl folder, so its ``__init__`` never runs. The stubs
and the finder are removed again afterwards (as are the environment variables verl's modules set at
import), so nothing else in the test process sees a fake ray.

The installed verl must be the version ``requirements-verl.txt`` pins (``make install-test`` installs it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from pathlib import Path

PIN_FILE = Path(__file__).with_name("requirements-verl.txt")


def pinned_version() -> str:
    """The verl version ``requirements-verl.txt`` pins (its one ``verl==X`` line)."""
    for line in PIN_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("verl=="):
            return line.split("==", 1)[1].strip()
    raise RuntimeError(f"{PIN_FILE}: no verl==VERSION line")


class _Dummy:
    """Whatever a stub ray attribute is: callable, subclassable, every attribute another dummy."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Dummy:
        return _Dummy()

    def __getattr__(self, name: str) -> _Dummy:
        return _Dummy()


def _stub_attr(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    # Capitalised names (ObjectRef, ActorHandle) are used as classes and in isinstance checks.
    return type(name, (_Dummy,), {}) if name[:1].isupper() else _Dummy()


class _RayStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "ray" or fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stub_attr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@functools.cache
def load_verl() -> types.SimpleNamespace:
    """``core_algos``, ``rollout_corr_helper``, ``torch_functional``, the engine workers' loss functions and
    the config classes of the pinned verl.

    Raises ImportError (verl or one of its light dependencies missing) or RuntimeError (another version).
    """
    want = pinned_version()
    try:
        have = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"verl is not installed (the reference suite needs verl=={want})") from None
    if have != want:
        raise RuntimeError(f"verl {have} is installed; the reference suite compares against verl=={want}")
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is installed but its package folder cannot be found")

    if "verl" not in sys.modules:
        package = types.ModuleType("verl")
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = spec.origin
        package.__version__ = have  # type: ignore[attr-defined]
        package.__spec__ = importlib.machinery.ModuleSpec("verl", None, is_package=True)
        package.__spec__.submodule_search_locations = package.__path__
        sys.modules["verl"] = package

    stubs = _RayStubs()
    environ = dict(os.environ)
    had_ray = {name for name in sys.modules if name == "ray" or name.startswith("ray.")}
    sys.meta_path.insert(0, stubs)
    try:
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        rollout_corr = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
        torch_functional = importlib.import_module("verl.utils.torch_functional")
        trainer_config = importlib.import_module("verl.trainer.config")
        workers_config = importlib.import_module("verl.workers.config")
        # The actor's and critic's loss functions of verl's engine workers (what update_actor calls per
        # micro-batch): they compose core_algos' policy loss, KL, entropy and value loss with the global
        # batch normalisation.
        engine_losses = importlib.import_module("verl.workers.utils.losses")
        tensordict_utils = importlib.import_module("verl.utils.tensordict_utils")
    finally:
        sys.meta_path.remove(stubs)
        for name in [n for n in sys.modules if (n == "ray" or n.startswith("ray.")) and n not in had_ray]:
            del sys.modules[name]
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
    return types.SimpleNamespace(
        version=have,
        core_algos=core_algos,
        rollout_corr=rollout_corr,
        F=torch_functional,
        AlgoConfig=trainer_config.AlgoConfig,
        ActorConfig=workers_config.ActorConfig,
        losses=engine_losses,
        tu=tensordict_utils,
    )
