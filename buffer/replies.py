"""Redis replies as Python values, in one place.

tether's Redis clients do not decode responses (payloads are binary), so stream ids, hash fields and
set members come back as ``bytes``; a client made with ``decode_responses=True`` hands back ``str``.
Every module that reads a reply goes through these helpers rather than decoding by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def text(raw: object, *, errors: str = "strict") -> str:
    """A reply (``bytes`` or ``str``) as ``str``; ``errors`` as for :meth:`bytes.decode`."""
    return raw.decode(errors=errors) if isinstance(raw, bytes) else str(raw)


def str_keys(raw: Mapping) -> dict[str, Any]:
    """A Redis hash with its fields as ``str``; the values as they came."""
    return {text(k): v for k, v in raw.items()}


def int_hash(raw: Mapping) -> dict[str, int]:
    """A Redis hash of counts (``HINCRBY`` fields) as ``{str: int}``."""
    return {text(k): int(v) for k, v in raw.items()}
