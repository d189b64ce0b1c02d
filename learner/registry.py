"""The learner's open registries (policy losses, advantage estimators): one lookup, one error a user can act on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str, *, key: str, what: str, decorator: str) -> T:
    """``table[name]``; a missing name is a ValueError naming the config ``key``, the known names and the
    ``decorator`` that registers a new one."""
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise ValueError(
            f"{key}: no {what} for {name!r} (known: {known}) — decorate one with @{decorator}({name!r}) in a "
            "module the learner imports"
        ) from None
