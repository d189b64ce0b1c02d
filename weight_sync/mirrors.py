"""Copies of the store a fleet pulls versions from: ``weight_sync.transport.mirrors``, one URL each.

The learner writes each version once into the store directory (``weight_sync.store``: ``chunks/ab/<hash>``,
``manifests/v00000020.base.json``, the manifest last). Anything that serves a copy of that layout — the
directory under another mount, an object-store bucket it is synced to, an HTTP server over it — is a
place a server can pull from without asking the learner. The URL's scheme picks the class (:data:`MIRRORS`);
the puller builds one source per URL when it starts (an unknown scheme stops it there, naming the known
ones) and asks them after its peers and before the relays and the origin (``weight_sync.puller``).

A mirror need not be trusted with chunks: the fetch checks each against its hash and asks the next source
for a bad one (``weight_sync.sources.Fetcher``). Its plan — the manifests, which name those hashes — is
believed, so a mirror copies the run's own store: it may lag or lose files (a miss sends the fetch on),
never write its own.

A new kind is a class and a line in :data:`MIRRORS`: a :class:`LayoutMirror` subclass reads one file of the
layout by its path (:meth:`LayoutMirror.read`) and inherits the planning, or a class of its own implements
:class:`~weight_sync.sources.Source` (``plan`` and ``chunk``) whole (docs/EXTENDING.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from weight_sync.manifest import Manifest, WeightVersionError
from weight_sync.sources import DirSource, ProviderSource, Source
from weight_sync.store import KINDS, VersionMissing, chunk_name, manifest_name, plan_chain
from weight_sync.versions import ChunkMissing

MIRRORS: dict[str, str] = {"file": "weight_sync.mirrors:file_mirror"}
"""URL scheme -> what builds a mirror's source from its URL (``module:name`` of a class or function taking the
URL, imported on use, so a mirror's client library is needed only where a config lists one). The one
registration of a mirror; its source is named ``mirror:<url>`` in logs and fetch stats."""


def mirror_source(url: str) -> Source:
    """The source a ``weight_sync.transport.mirrors`` entry names; a ValueError naming the known schemes when
    its scheme has no entry in :data:`MIRRORS`."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in MIRRORS:
        raise ValueError(
            f"weight_sync.transport.mirrors: {url!r} has no known scheme (known: {', '.join(sorted(MIRRORS))}) — "
            "fix the URL, or add its scheme's class to weight_sync.mirrors.MIRRORS (docs/EXTENDING.md)"
        )
    module, _, name = MIRRORS[scheme].partition(":")
    build: Callable[[str], Source] = getattr(importlib.import_module(module), name)
    return build(url)


def file_mirror(url: str) -> Source:
    """``file:///path``: a copy of the store directory this server mounts (a synced copy, a read-only mount
    of the learner's store under another path)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(f"weight_sync.transport.mirrors: {url!r}: a file mirror is file:///absolute/path")
    return ProviderSource(DirSource(Path(unquote(parts.path))), name=f"mirror:{url}")


class LayoutMirror:
    """A :class:`~weight_sync.sources.Source` over a copy of the store's layout that reads files by path: a
    subclass implements :meth:`read`, and plans like the store itself (:func:`weight_sync.store.plan_chain`),
    reading only the manifests of the versions it walks — no listing, so a plain HTTP server will do. It
    plans the version asked for (the announced one), never "the latest"."""

    plan_timeout_s = 10.0
    """Deadline for reading one manifest."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = f"mirror:{url}"

    def read(self, path: str, *, timeout_s: float) -> bytes | None:
        """The bytes of the file at ``path``, relative to the store's root (``manifests/v00000020.base.json``,
        ``chunks/3f/3f9a…``), or None when this copy has no such file; raise
        :class:`~weight_sync.sources.SourceUnavailable` when it cannot answer within ``timeout_s``."""
        raise NotImplementedError

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        if version is None:
            raise VersionMissing(f"{self.name}: a mirror plans a version by its number, not the latest")
        found: dict[int, dict[str, Manifest]] = {}

        def kinds(k: int) -> dict[str, Manifest]:
            if k not in found:
                found[k] = {}
                for kind in KINDS:
                    data = self.read(manifest_name(k, kind), timeout_s=self.plan_timeout_s)
                    if data is not None:
                        found[k][kind] = self._manifest(data, k, kind)
            return found[k]

        return plan_chain(version, held, kinds=kinds, manifest=lambda k, kind: found[k][kind], where=self.name)

    def _manifest(self, data: bytes, version: int, kind: str) -> Manifest:
        where = f"{self.name}/{manifest_name(version, kind)}"
        m = Manifest.from_json(data, where=where)
        if m.version != version or m.kind != kind:
            raise WeightVersionError(f"{where} holds v{m.version} ({m.kind}), not v{version} ({kind})")
        return m

    def chunk(self, digest: str, *, timeout_s: float) -> bytes:
        data = self.read(chunk_name(digest), timeout_s=timeout_s)
        if data is None:
            raise ChunkMissing(f"{self.name}: no chunk {digest}")
        return data
