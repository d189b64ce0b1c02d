"""Loading by adoption: parameters become views into the received buffers; bad updates change nothing;
an engine's ``load_weights`` adopts only what weight sync offers as adoptable."""

from __future__ import annotations

import pytest
import torch

from weight_sync.adopt import adopt_into_module, load_into_module
from weight_sync.loading import Tally


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight  # one Parameter under two names
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))


def test_adopts_same_dtype_and_casts_the_rest_keeping_ties() -> None:
    model = Tied()
    flat = torch.randn(7 * 4 + 4)
    embed, norm = flat[:28].view(7, 4), flat[28:]
    tally = Tally()
    adopted = adopt_into_module(model, list(tally.count([("embed.weight", embed), ("norm", norm)], sums=True)))
    nbytes, sums = tally.bytes, tally.checksums
    assert adopted == 1 and nbytes == flat.numel() * 4
    assert model.embed.weight.data_ptr() == flat.data_ptr() and model.head.weight is model.embed.weight
    torch.testing.assert_close(model.norm, norm.to(torch.bfloat16), rtol=0, atol=0)  # copied (cast)
    assert model.norm.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert sums["embed.weight"] == pytest.approx(float(embed.double().sum()))
    flat.mul_(2)  # the buffer is the weight now: a later write shows (why the receiver keeps a second set)
    torch.testing.assert_close(model.head.weight, embed, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("named", "error"),
    [
        ([("embed.weight", torch.zeros(7, 4)), ("missing", torch.zeros(1))], KeyError),
        ([("embed.weight", torch.zeros(7, 4)), ("norm", torch.zeros(5))], ValueError),
    ],
)
def test_a_bad_update_changes_nothing(named: list, error: type) -> None:
    model = Tied()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptr = model.embed.weight.data_ptr()
    with pytest.raises(error):
        adopt_into_module(model, named)
    assert model.embed.weight.data_ptr() == ptr
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=0)


def test_load_into_module_copies_what_is_not_adoptable_and_says_what_it_kept() -> None:
    flat = torch.randn(7 * 4)
    update = [("embed.weight", flat.view(7, 4))]
    copied = Tied()
    assert not load_into_module(copied, update, adoptable=False).kept  # a snapshot's tensors: copied
    assert copied.embed.weight.data_ptr() != flat.data_ptr()
    torch.testing.assert_close(copied.head.weight, flat.view(7, 4), rtol=0, atol=0)
    adopted = Tied()
    assert load_into_module(adopted, iter(update), adoptable=True).kept  # received buffers: adopted
    assert adopted.embed.weight.data_ptr() == flat.data_ptr() and adopted.head.weight is adopted.embed.weight


def test_a_copy_that_fails_after_its_first_tensor_says_the_weights_are_mixed() -> None:
    from weight_sync.adopt import copy_into_module
    from weight_sync.loading import PARTIAL_UPDATE, PartialUpdate

    model = Tied()
    before = model.embed.weight.detach().clone()
    with pytest.raises(KeyError):  # the first tensor is refused: nothing changed, an ordinary error
        copy_into_module(model, [("nope", torch.zeros(4))])
    new = torch.randn(7, 4)
    with pytest.raises(PartialUpdate, match=PARTIAL_UPDATE):  # one tensor copied, then a wrong shape
        copy_into_module(model, [("embed.weight", new), ("norm", torch.zeros(5, dtype=torch.bfloat16))])
    torch.testing.assert_close(model.embed.weight, new, rtol=0, atol=0)  # what the error says: mixed
    assert not torch.equal(before, new)
