"""Whether the learner's attention can run where it will run: one check, made twice.

The learner makes it as it loads the model (:func:`learner.parallelize.attn_implementation`), and ``tether
up`` makes it before it starts any process (:func:`tether.commands.launcher.check_attention`), so a setting
the machine cannot run fails in a second, with the same message, instead of inside torchrun after the
servers have loaded their engines. Hence no torch import here: the caller says what the machine has (CUDA,
torch's varlen kernel), and this module says what the config asks of it.

What can be refused: ``model.attn_implementation: flash_attention_2`` without CUDA or without the flash-attn
package, and ``learner.varlen_attention: torch`` (packed rows through torch's flash varlen kernel) without
CUDA, torch >= 2.10 or half-precision compute.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from typing import Literal

from tether.config import TetherConfig

AttentionPath = Literal["ulysses", "varlen", "model"]


class AttentionUnavailable(RuntimeError):
    """The configured attention cannot run here; the message names the setting to change."""


def attention_path(cfg: TetherConfig) -> AttentionPath:
    """Where the learner's attention runs: inside sequence parallelism's all-to-alls (``ulysses``), the varlen
    kernels for packed rows with sdpa/eager (``varlen``, :mod:`learner.varlen_attention`), or the model's own
    ``model.attn_implementation`` (flash_attention_2 has its own varlen kernel)."""
    if cfg.learner.ulysses_sequence_parallel_size > 1:
        return "ulysses"
    if cfg.learner.use_remove_padding and cfg.model.attn_implementation in ("sdpa", "eager"):
        return "varlen"
    return "model"


def check_flash(impl: str, *, cuda: bool) -> None:
    """``model.attn_implementation: flash_attention_2`` needs CUDA and the flash-attn package."""
    if impl != "flash_attention_2":
        return
    if not cuda:
        raise AttentionUnavailable("model.attn_implementation: flash_attention_2 needs a GPU; use sdpa on CPU")
    if importlib.util.find_spec("flash_attn") is None:
        raise AttentionUnavailable(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package "
            "(pip install -e .[gpu]) — or set it to sdpa"
        )


def check_varlen_kernel(cfg: TetherConfig, *, runs: bool, device: str, torch_version: str) -> str:
    """``learner.varlen_attention``, refused when torch's kernel is asked for and ``runs`` is false: it needs
    CUDA, torch >= 2.10 and half-precision compute."""
    want = cfg.learner.varlen_attention
    if want == "torch" and not runs:
        raise AttentionUnavailable(
            "learner.varlen_attention: torch needs CUDA, torch >= 2.10 and param_dtype bfloat16 "
            f"(device {device}, torch {torch_version}, param_dtype {cfg.learner.param_dtype}); use split"
        )
    return want


def half_precision(cfg: TetherConfig, *, cuda: bool) -> bool:
    """Whether the learner computes in bf16: ``learner.param_dtype`` bfloat16, or ``auto`` on CUDA."""
    name = cfg.learner.param_dtype
    return name == "bfloat16" or (name == "auto" and cuda)


def check_attention(cfg: TetherConfig, *, cuda: bool, torch_varlen: bool, torch_version: str) -> None:
    """Raise :class:`AttentionUnavailable` where the learner could not run its attention: on CUDA or not
    (``cuda``), with torch's varlen kernel present or not (``torch_varlen``)."""
    path = attention_path(cfg)
    if path == "varlen":
        runs = cuda and torch_varlen and half_precision(cfg, cuda=cuda)
        check_varlen_kernel(cfg, runs=runs, device="cuda" if cuda else "cpu", torch_version=torch_version)
    else:
        check_flash(cfg.model.attn_implementation, cuda=cuda)


def installed_torch() -> tuple[str, bool]:
    """The installed torch's version, and whether it has the varlen kernel (>= 2.10), without importing it."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)", False
    m = re.match(r"(\d+)\.(\d+)", version)
    return version, m is not None and (int(m.group(1)), int(m.group(2))) >= (2, 10)
