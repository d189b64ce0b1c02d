"""The planner's weight path (tether/commands/plan/weights.py): the pull tree against the parent rule it is defined
by, pull time against push as the fleet grows, the bytes each side sends, today's figure kept bit for bit,
and bad values refused by name, from a flag or a rates file."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from tether.commands.cli import main
from tether.commands.plan.rates import DEFAULT_RATES, Rates, fleet_for, load_rates, weight_path, with_weight_flags
from tether.commands.plan.weights import (
    DECODE_GB_PER_S,
    ENCODE_GB_PER_S,
    MEASURED_DELTA_RATIO,
    WeightPath,
    full_push,
    sync_cost,
    tree_depth,
    tree_levels,
    tree_parent,
)
from tether.config import ConfigError, load_config

RATES_DIR = DEFAULT_RATES.parent
FULL = 15.2e9  # a 7.6B policy's bf16 bytes
LINK = 40.0  # GB/s


def _depth_by_walking(rank: int, fanout: int) -> int:
    d, r = 1, rank
    while (r := tree_parent(r, fanout)) is not None:
        d += 1
    return d


@pytest.mark.parametrize("fanout", [2, 3, 4, 7])
def test_tree_depth_is_the_deepest_chain_of_the_parent_rule(fanout: int) -> None:
    """Roots 0..k-1 fetch from the origin, r >= k from (r - k) // k: a k-ary tree, as deep as the closed form."""
    for servers in [*range(1, 200), 1000, 4097]:
        depths = [_depth_by_walking(r, fanout) for r in range(servers)]
        assert tree_depth(servers, fanout) == max(depths)
        assert tree_levels(servers, fanout) == [depths.count(d) for d in range(1, max(depths) + 1)]
        assert (
            math.ceil(math.log(servers, fanout) - 1e-9) - 1
            <= max(depths)
            <= max(1, math.ceil(math.log(servers, fanout) - 1e-9))
        )
    children = np.bincount([tree_parent(r, fanout) for r in range(fanout, 500)])
    assert children.max() == fanout and all(tree_parent(r, fanout) < r for r in range(fanout, 500))


def test_pull_time_grows_with_log_n_and_a_star_with_n() -> None:
    path = WeightPath(link_gb_per_s=LINK, fanout=2)
    hop = 2 * MEASURED_DELTA_RATIO * FULL / (LINK * 1e9)  # a parent's uplink carries its two children's copies
    fleet = [64 * 2**j for j in range(7)]  # 64 ... 4096 servers
    pull = [sync_cost(path, full_bytes=FULL, servers=n) for n in fleet]
    assert [c.hops for c in pull] == [6, 7, 8, 9, 10, 11, 12]  # 64 servers: 2 + 4 + 8 + 16 + 32 < 64 <= 126
    for c in pull:
        assert c.transfer_s == pytest.approx(c.hops * hop)
    assert pull[-1].seconds - pull[0].seconds == pytest.approx(6 * hop)  # 64x the servers: 6 more hops
    # fanout >= N is every server fetching from the origin: one hop whose uplink carries N copies
    star = [sync_cost(replace(path, fanout=n), full_bytes=FULL, servers=n) for n in fleet]
    assert [c.hops for c in star] == [1] * 7
    assert star[-1].transfer_s / star[0].transfer_s == pytest.approx(64)


def test_pull_origin_bytes_do_not_grow_with_the_fleet_and_push_bytes_do() -> None:
    path = WeightPath(link_gb_per_s=LINK, fanout=3, delta_ratio=0.05, base_every=20)
    per_version = 0.05 * FULL  # a server that keeps up never fetches a base
    for n in (64, 65, 500, 4096):
        pull = sync_cost(path, full_bytes=FULL, servers=n)
        push = sync_cost(full_push(path), full_bytes=FULL, servers=n)
        assert pull.origin_bytes == pytest.approx(3 * per_version)
        assert pull.wire_bytes == pytest.approx(n * per_version)
        assert push.origin_bytes == push.wire_bytes == pytest.approx(n * FULL)
    assert sync_cost(path, full_bytes=FULL, servers=2).origin_bytes == pytest.approx(2 * per_version)


def test_pull_time_is_latency_encode_hops_decode() -> None:
    """The defaults at 64 servers, by hand: 6 hops of 2 copies of the delta, the codec at its measured rates."""
    path = WeightPath(link_gb_per_s=LINK, latency_s=0.5, fanout=2)
    c = sync_cost(path, full_bytes=FULL, servers=64)
    encode, decode = FULL / (ENCODE_GB_PER_S * 1e9), FULL / (DECODE_GB_PER_S * 1e9)
    wire = 6 * 2 * 0.0123 * FULL / 40e9
    assert (c.encode_s, c.decode_s) == (pytest.approx(encode), pytest.approx(decode))
    assert c.seconds == pytest.approx(0.5 + encode + wire + decode)
    assert c.base_seconds == pytest.approx(0.5 + encode + 6 * 2 * FULL / 40e9 + decode)
    faster = sync_cost(replace(path, codec_cores=8), full_bytes=FULL, servers=64)
    assert faster.seconds == pytest.approx(0.5 + (encode + decode) / 8 + wire)
    # delta_ratio 1.0: full weights every version, no codec, no separate base
    full = sync_cost(replace(path, delta_ratio=1.0), full_bytes=FULL, servers=64)
    assert (full.codec_s, full.base_seconds) == (0.0, full.seconds)
    assert full.wire_bytes == 64 * FULL


def test_break_even_is_where_the_two_paths_take_as_long() -> None:
    path = WeightPath(link_gb_per_s=LINK, latency_s=0.5)
    today = full_push(path)
    factor = sync_cost(path, full_bytes=FULL, servers=64).break_even(sync_cost(today, full_bytes=FULL, servers=64))
    assert factor is not None and factor > 1
    slow = replace(path, link_gb_per_s=LINK / factor)
    assert sync_cost(slow, full_bytes=FULL, servers=64).seconds == pytest.approx(
        sync_cost(full_push(slow), full_bytes=FULL, servers=64).seconds
    )
    more_cores = replace(path, codec_cores=math.ceil(factor) + 1)
    assert (
        sync_cost(more_cores, full_bytes=FULL, servers=64).seconds
        < sync_cost(today, full_bytes=FULL, servers=64).seconds
    )


@pytest.mark.parametrize("name", ["h100-7b.yaml", "h100-32b.yaml"])
def test_full_push_reproduces_the_figure_before_the_weight_service_exactly(name: str) -> None:
    rates = load_rates(RATES_DIR / name)
    cfg = load_config(None, ["--learner.train_batch_size", "64"])
    ws = rates.weight_sync
    before = ws.latency_s + 2 * rates.model_params / (ws.gb_per_s * 1e9)  # the planner's formula until now
    for rollout in (64, 256, 2048):
        push = fleet_for(
            cfg, with_weight_flags(rates, delta_ratio=1.0, fanout="push"), learner_gpus=8, rollout_gpus=rollout
        )
        assert push.sync_s == before  # bit for bit, at any fleet size
        pull = fleet_for(cfg, rates, learner_gpus=8, rollout_gpus=rollout)
        assert replace(pull, sync_s=before) == push  # the weight path changes nothing else in the fleet


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"delta_ratio": -0.1}, r"--delta-ratio\) must be > 0 and <= 1"),
        ({"delta_ratio": 0.0}, r"--delta-ratio"),
        ({"delta_ratio": 1.5}, r"--delta-ratio"),
        ({"fanout": 1}, r"--fanout\) must be 0 .* got 1; 1 would chain every server"),
        ({"fanout": -2}, r"--fanout"),
        ({"base_every": 0}, r"--base-every\) must be >= 1"),
        ({"codec_cores": 0}, r"--codec-cores"),
        ({"encode_gb_per_s": 0}, r"--encode-gb-per-s\) must be > 0"),
        ({"decode_gb_per_s": -1}, r"--decode-gb-per-s"),
        ({"fanout": "pull"}, r"--fanout: .*integer"),
    ],
)
def test_bad_weight_path_values_are_refused_by_name(flags: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        with_weight_flags(load_rates(None), **flags)


def test_rates_files_carry_the_weight_path_and_check_it(tmp_path: Path) -> None:
    data = yaml.safe_load(DEFAULT_RATES.read_text())
    defaults = WeightPath(link_gb_per_s=40, latency_s=0.5, delta_ratio=1.0)  # a push of full weights
    assert weight_path(Rates.model_validate(data)) == defaults
    pulled = weight_path(with_weight_flags(Rates.model_validate(data), fanout=2))
    assert (pulled.mode, pulled.delta_ratio) == ("pull", MEASURED_DELTA_RATIO)  # a pull: the measured ratio
    data["weight_sync"].update({"fanout": "push", "delta_ratio": 0.0543, "base_every": 50})
    path = weight_path(Rates.model_validate(data))
    assert (path.mode, path.delta_ratio, path.base_every) == ("push", 0.0543, 50)
    data["weight_sync"]["fanout"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"weight_sync\.fanout"):
        weight_path(load_rates(bad))
    assert with_weight_flags(load_rates(bad), fanout=4).weight_sync.fanout == 4  # a flag overrides the file


def test_cli_prints_push_beside_pull_and_writes_both(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    small = ["--rollout.n", "4", "--learner.train_batch_size", "8", "--rollout.max_tokens", "256"]
    split = ["--learner-gpus", "8", "--rollout-gpus", "64"]
    assert main(["plan", *split, "--json", str(tmp_path / "p.json"), *small]) == 0
    out = capsys.readouterr().out
    assert "weight sync to 64 servers" in out
    assert "  * push, full (today)" in out and "    pull, fanout 2, delta 0.0123" in out  # push simulated: the default
    assert "the pull is slower than the push here" in out  # one core of codec against a 40 GB/s link
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["weight_sync_pull"]["hops"] == 6 and got["weight_sync_full_push"]["mode"] == "push"
    assert got["weight_sync_pull"]["origin_bytes"] < got["weight_sync_full_push"]["origin_bytes"] / 30

    assert main(["plan", *split, "--fanout", "push", "--delta-ratio", "1", *small]) == 0
    out = capsys.readouterr().out
    assert "  * push, full (today)" in out and "    pull, fanout 2" in out
    assert main(["plan", *split, "--fanout", "4", "--codec-cores", "10000", *small]) == 0
    out = capsys.readouterr().out
    assert "  * pull, fanout 4" in out and "slower than the push" not in out
    assert main(["plan", *split, "--fanout", "1", *small]) == 2
    assert "--fanout" in capsys.readouterr().err
