"""Ulysses' pure pieces: cutting a packed row into SP shards, and the config that refuses padded rows."""

from __future__ import annotations

import pytest
import torch

from learner.ulysses import Layout, shard_row
from tether.config import TetherConfig


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_shards_cover_the_row_and_own_each_scored_position_once(sp: int) -> None:
    torch.manual_seed(sp)
    lengths = [5, 9, 2, 7]
    total = sum(lengths)
    ids = torch.randint(0, 100, (1, total))
    logit_index = torch.tensor(sorted(torch.randperm(total - 1)[:12].tolist()))
    shards = [shard_row(ids, logit_index, lengths, Layout(sp, r, 1, 0, None), pad_id=-1) for r in range(sp)]
    row = torch.cat([s.input_ids for s in shards], dim=1)
    assert row.shape[1] % sp == 0 and row.shape[1] - total < sp
    assert torch.equal(row[:, :total], ids) and (row[:, total:] == -1).all()
    assert sum(shards[0].lengths) == row.shape[1]  # the padding is a sequence of its own
    pos = torch.cat([s.position_ids for s in shards], dim=1)[0]
    assert torch.equal(pos[:total], torch.cat([torch.arange(n) for n in lengths]))
    width = row.shape[1] // sp
    owned = torch.cat([s.logit_index + r * width for r, s in enumerate(shards)])
    assert torch.equal(owned, logit_index)  # in row order, each position on exactly one rank
    assert shards[0].counts == [int(s.local.sum()) for s in shards]


def test_sequence_parallel_needs_packed_rows() -> None:
    with pytest.raises(ValueError, match="use_remove_padding"):
        TetherConfig.model_validate({"learner": {"ulysses_sequence_parallel_size": 2, "use_remove_padding": False}})
