"""The transformers engine's running batch: rows that join and leave one shared, left-padded KV cache.

Rows are right-aligned: every row's newest token sits in the last column, and a row's earlier columns
are either its own tokens (attention mask 1) or padding (mask 0). Keys are stored after the rotary
embedding of each row's own positions, so a row's columns may shift left or right without changing what
they mean; that is what lets rows of different lengths share the cache.

* **join** (:meth:`RunningBatch.join`): the rows of a new prefill are appended on the batch dimension,
  the shorter side left-padded with masked zeros to the longer one's width;
* **leave** (:meth:`RunningBatch.keep`): finished rows are dropped, and then the leading columns that
  are padding for every remaining row are cut, so the cache never grows past the longest live row.

Only caches whose layers are all plain ``DynamicLayer`` (full attention) can be re-laid out this way;
for any other cache (sliding windows, linear attention, …) :attr:`RunningBatch.joinable` is false and
the engine lets new rows in only when the batch is empty, as static batching does. A sliding-window model
whose rows can never outgrow its window (``model.max_model_len`` at most the window: Gemma 3's 512) gets
full layers (:func:`new_cache`): a window no row reaches masks nothing, so the logits are the same — checked
on the real Gemma 3 270M — and its rows join and leave like any other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rollout_server.engines.sampling import RowParams


def new_cache(config: Any, *, longest: int) -> Any:
    """The KV cache of a new batch of rows at most ``longest`` tokens long (prompt and completion): the
    model's own (``DynamicCache(config=...)``), or all full-attention layers where its only other kind is a
    sliding window no row can outgrow, so that rows can join a running batch (see the module docstring)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if _joinable(cache) or not _window_never_bites(config, longest):
        return cache
    return DynamicCache()


def _window_never_bites(config: Any, longest: int) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ["sliding_attention"])
    window = getattr(text, "sliding_window", None)
    return kinds <= {"full_attention", "sliding_attention"} and window is not None and longest <= window


def _joinable(cache: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


class RunningBatch:
    """Rows decoding together: their KV cache, attention mask, next positions, next inputs, sampling."""

    def __init__(self, *, cache: Any, mask: torch.Tensor, pos: torch.Tensor, params: RowParams) -> None:
        self.cache = cache
        self.mask = mask  # [B, L]: 1 where the cache column is the row's token
        self.pos = pos  # [B]: the position of each row's next input token
        self.params = params
        self.last: torch.Tensor | None = None  # [B]: each row's next input token (set after sampling)
        self.joinable = _joinable(cache)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def join(self, other: RunningBatch) -> None:
        """Append ``other``'s rows (after this batch's rows); both must be :attr:`joinable`."""
        width = max(self.width, other.width)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(other.mask, (width - other.width, 0))])
        self.pos = torch.cat([self.pos, other.pos])
        self.params = self.params.concat(other.params)
        assert self.last is not None and other.last is not None
        self.last = torch.cat([self.last, other.last])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices, in order); cut the columns that are padding for all of them."""
        if len(rows) == self.mask.shape[0]:
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        live = mask.any(dim=0).nonzero()
        cut = int(live[0]) if len(live) and self.joinable else 0
        if self.joinable:
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(0, idx)[:, :, cut:]
                layer.values = layer.values.index_select(0, idx)[:, :, cut:]
        else:
            self.cache.batch_select_indices(idx)
        self.mask = mask[:, cut:]
        self.pos = self.pos.index_select(0, idx)
        self.params = self.params.select(idx)
        if self.last is not None:
            self.last = self.last.index_select(0, idx)


def _left_pad(kv: torch.Tensor, width: int) -> torch.Tensor:
    """``kv`` [B, H, L, D] with ``width - L`` zero columns in front."""
    return F.pad(kv, (0, 0, width - kv.shape[2], 0)) if kv.shape[2] < width else kv
