"""How much network latency the staleness bound absorbs: samples/s and weight-sync time across separate hosts.

    sudo python bench/cluster.py                   # RTT 0/10/50 ms x max_staleness 0/1/2, 3 repeats
    sudo python bench/cluster.py --quick           # one repeat, RTT 0/50, staleness 0/1, few steps

The hosts are those of ``tests/cluster`` (network namespaces joined by a userspace switch, the commands of
docs/FLEETS.md): Redis, a learner on two nodes, two rollout hosts, a reward host. The round-trip time is put
on the links between the learner nodes and the rollout hosts only (half each way), where weight updates and
the control RPCs travel; Redis stays near both, as in most deployments. For each RTT and each
``algorithm.max_staleness`` (0 is synchronous: generation and training alternate) the run's samples/s is
timed from the end of step ``--skip`` to the last step, and the mean ``timing/weight_sync`` is read from
its metrics. The figures are each mode's samples/s at a given RTT over the same mode's at RTT 0 (what the
latency costs it), median and min–max over repeats, with the order of the configurations rotated from one
repeat to the next. Root only (namespaces); the switch moves every packet in Python, so absolute rates are
far below a real network's — compare the ratios, not the rates. Never asserted by a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, ordered, report  # noqa: E402

SAMPLES_PER_STEP = 4 * 4  # the cluster's train_batch_size x n


def run_once(folder: Path, model: Path, *, rtt_ms: float, staleness: int, steps: int, skip: int) -> dict:
    from tests.cluster.cluster import Cluster

    cluster = Cluster(folder, model, steps=steps, staleness=staleness)
    try:
        for learner in ("learner0", "learner1"):
            for rollout in ("rollout0", "rollout1"):
                if rtt_ms:
                    cluster.lab.set_link(learner, rollout, delay_ms=rtt_ms / 2)
        cluster.start()
        cluster.wait_finished(timeout_s=900)
        rows = cluster.steps_done()
    finally:
        cluster.close()
    timed = [r for r in rows if r["step"] > skip]
    seconds = timed[-1]["time"] - rows[skip - 1]["time"] if skip else timed[-1]["time"] - timed[0]["time"]
    return {
        "samples_per_s": SAMPLES_PER_STEP * len(timed) / seconds,
        "weight_sync_s": statistics.fmean(r.get("timing/weight_sync", 0.0) for r in timed),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat of RTT 0/50 x staleness 0/1, 12 steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=3, help="steps left out of the timing (start-up)")
    p.add_argument("--rtts", default="0,10,50", help="round-trip times in ms between learner and rollout hosts")
    p.add_argument("--modes", default="0,1,2", help="max_staleness values")
    args = p.parse_args(argv)
    from tests.cluster.netlab import can_run

    reason = can_run()
    if reason:
        print(f"bench/cluster.py: cannot build the hosts here ({reason})")
        return 2
    if args.quick:
        args.repeats, args.steps, args.rtts, args.modes = 1, 12, "0,50", "0,1"
    rtts = [float(x) for x in args.rtts.split(",")]
    modes = [int(x) for x in args.modes.split(",")]
    configs = [(rtt, mode) for rtt in rtts for mode in modes]
    results: dict[tuple[float, int], list[dict]] = {c: [] for c in configs}
    from tether.commands.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="tether-bench-cluster-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden=64, layers=2, heads=2, seed=0)
        for r in range(args.repeats):
            for k, (rtt, mode) in enumerate(ordered(configs, r)):
                print(f"repeat {r + 1}/{args.repeats}: RTT {rtt:g} ms, max_staleness {mode} ...", flush=True)
                out = Path(tmp) / f"r{r}-{k}"
                results[(rtt, mode)].append(
                    run_once(out, model, rtt_ms=rtt, staleness=mode, steps=args.steps, skip=args.skip)
                )
    print(f"\n{'RTT ms':>7}" + "".join(f"{'staleness ' + str(m) + ' samples/s':>28}{'sync s':>9}" for m in modes))
    for rtt in rtts:
        cells = ""
        for m in modes:
            sps = [x["samples_per_s"] for x in results[(rtt, m)]]
            sync_s = statistics.fmean(x["weight_sync_s"] for x in results[(rtt, m)])
            cells += f"{statistics.median(sps):>14.1f} ({min(sps):.1f}-{max(sps):.1f})".rjust(28) + f"{sync_s:>9.3f}"
        print(f"{rtt:>7g}" + cells)
    base = min(rtts)
    for rtt in rtts:
        if rtt == base:
            continue
        for m in modes:
            pairs = zip(results[(rtt, m)], results[(base, m)], strict=True)
            ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
            name = f"cluster/rtt{rtt:g}ms_staleness{m}_samples_per_s"
            baseline = f"the same max_staleness at RTT {base:g} ms, same repeat"
            report(figure(name, ratios, goal=None, direction="min", baseline=baseline), quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
