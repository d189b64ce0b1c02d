"""Layers of config: defaults, then a YAML file, then dotted CLI overrides; errors name the key.

``load_config("cfg.yaml", ["--learner.lr", "1e-6", "--rollout.engine.type=vllm"])`` returns a
validated :class:`TetherConfig` or raises :class:`ConfigError` whose message is one line per
problem, e.g. ``learner.lr: Input should be greater than 0 (got -1)``. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tether.config.policy_loss import PolicyLossConfig, policy_loss_config_class
from tether.config.root import TetherConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message says which key and why."""


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--a.b", "1", "--c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values are parsed as YAML."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r}: expected --section.key VALUE or --section.key=VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key}: missing value")
            value = args[i + 1]
            i += 1
        i += 1
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override --{key}: empty key segment")
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override --{key}: {part} is set to a value and used as a section")
            node = child
        node[parts[-1]] = parsed
    return tree


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TetherConfig:
    data = read_yaml(path) if path else {}
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> TetherConfig:
    try:
        return TetherConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, data) for err in e.errors())) from None


def _describe(err: Any, data: dict[str, Any]) -> str:
    """One line for one pydantic error, with the dotted key as the user wrote it."""
    key, model = _user_path(err["loc"], data)
    if err["type"] == "union_tag_invalid":
        key += ".type"
    if err["type"] == "extra_forbidden":
        known = sorted(model.model_fields) if model else []
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        hint = f" — did you mean {close[0]!r}?" if close else (f" (known: {', '.join(known)})" if known else "")
        return f"{key}: unknown key{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing" or not isinstance(err.get("input"), str | int | float | bool | None):
        return f"{key}: {msg}"
    shown = repr(err["input"])
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{key}: {msg} (got {shown})"


def _user_path(loc: tuple[Any, ...], data: dict[str, Any]) -> tuple[str, type[BaseModel] | None]:
    """Drop the union-tag segments pydantic inserts; return the dotted key and the owning model."""
    parts: list[str] = []
    node: Any = data
    model: type[BaseModel] | None = TetherConfig
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            parts.append(str(part))
            if i < len(loc) - 1:
                model = _field_model(model, str(part), node[part])
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int):
            parts.append(str(part))
            node = node[part] if part < len(node) else None
        elif i == len(loc) - 1:
            parts.append(str(part))
        # else: a tagged-union segment such as "vllm"; the user never wrote it
    return ".".join(parts) or "config", model


def _field_model(model: type[BaseModel] | None, name: str, value: Any) -> type[BaseModel] | None:
    if model is None or name not in model.model_fields:
        return None
    annotation = model.model_fields[name].annotation
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    subs = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    if subs == [PolicyLossConfig] and isinstance(value, dict):  # an open registry keyed by loss_mode
        with contextlib.suppress(ValueError):
            return policy_loss_config_class(value.get("loss_mode", "vanilla"))
    if len(subs) > 1 and isinstance(value, dict):
        for sub in subs:  # a tagged union: pick the member the user's `type` names
            tag = sub.model_fields.get("type")
            if tag is not None and tag.default == value.get("type", subs[0].model_fields["type"].default):
                return sub
    return subs[0] if subs else None


def dump_config(cfg: TetherConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def save_resolved(cfg: TetherConfig, run_dir: str | Path) -> Path:
    """Write the resolved config to ``{run_dir}/config.yaml`` (atomically) and return its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(dump_config(cfg))
    tmp.replace(out)
    return out
