"""The ``tether plan`` subcommand: calibrate against a run, project one split, find the best, or sweep.

    tether plan --from-run runs/<id>                                 predicted vs measured for a finished run
    tether plan --config cfg.yaml --learner-gpus 8 --rollout-gpus 24 one split at the rates file's rates
    tether plan --config cfg.yaml --total-gpus 64                    the split with the most samples/s
    tether plan --config cfg.yaml --learner-gpus 8 --sweep docs/plan splits × max_staleness: a table and a PNG
    tether plan -c a.yaml -c b.yaml --learner-gpus 8,4 --rollout-gpus 16  runs sharing one rollout fleet

Several ``--config`` are several runs on one rollout fleet (``tether rollout --runs a,b``,
:mod:`tether.commands.plan.runs`): ``--rollout-gpus`` is the fleet, ``--learner-gpus`` each run's own learner
(one number for every run, or one per run in ``--config`` order), each run's ``rollout.share`` its weight, and
``--fleet-slots`` the groups a fleet server generates at once across the runs (the fleet config's
``rollout.prompt_workers``); dotted overrides apply to every run. It prints a table with a row per run.

``--rates FILE`` picks the rates (default ``configs/rates/h100-7b.yaml``); dotted overrides
(``--algorithm.max_staleness 2``) change the config as everywhere else. The weight path's flags
(``--delta-ratio``, ``--fanout``, ``--base-every``, ``--encode-gb-per-s``, ``--decode-gb-per-s``,
``--codec-cores``) replace the rates file's ``weight_sync`` fields of those names (:mod:`tether.commands.plan.weights`).
``--json FILE`` also writes the figures as JSON. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from tether.config import ConfigError, TetherConfig, load_config

if TYPE_CHECKING:
    from tether.commands.plan.project import Projection
    from tether.commands.plan.rates import Rates
    from tether.commands.plan.weights import SyncCost


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate the fleet: calibrate on a run, or project throughput, staleness, Redis")
    p.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        action="append",
        help="YAML config whose protocol is simulated; repeat it for several runs on one rollout fleet",
    )
    p.add_argument("--from-run", metavar="RUN_DIR", help="replay a finished run and compare with what it measured")
    p.add_argument("--rates", metavar="FILE", help="rates file (default configs/rates/h100-7b.yaml)")
    p.add_argument(
        "--learner-gpus",
        type=_counts,
        metavar="N[,N...]",
        help="learner GPUs (several --config: each run's, one number for all or one per run)",
    )
    p.add_argument("--rollout-gpus", type=int, help="rollout GPUs (several --config: the fleet they share)")
    p.add_argument(
        "--fleet-slots",
        type=int,
        metavar="N",
        help="several --config: groups one rollout server generates at once across the runs (the fleet's "
        "rollout.prompt_workers; default the rates file's max_num_seqs // the largest n)",
    )
    p.add_argument("--total-gpus", type=int, help="find the split of this many GPUs with the most samples/s")
    p.add_argument("--learner-step", type=int, default=8, help="learner GPUs come in multiples of this (default 8)")
    p.add_argument("--sweep", metavar="OUT_DIR", help="write sweep.md and sweep.png over --ratios × --staleness")
    p.add_argument("--ratios", default="0.25,0.5,1,2,3,4", help="rollout:learner GPU ratios of the sweep")
    p.add_argument("--staleness", default="0,1,2,4", help="max_staleness values of the sweep")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    _add_weight_flags(p)
    p.epilog = "Any further --section.key VALUE pairs override the config file."


def _add_weight_flags(p: argparse.ArgumentParser) -> None:
    """The weight path's flags, which replace the rates file's ``weight_sync`` fields of those names."""
    w = p.add_argument_group("weight path (default: the rates file's weight_sync, else the values below)")
    w.add_argument(
        "--delta-ratio",
        type=float,
        metavar="R",
        help="a version's delta bytes / its full bf16 bytes (default 0.0123, bench/weight_delta.py at "
        "lr 1e-6; 0.0543 at 1e-5); 1.0: full weights every version",
    )
    w.add_argument(
        "--fanout",
        type=_fanout,
        metavar="K",
        help="servers pull from peers in a K-ary tree (the store transport); 0 or 'push' (default, as "
        "the default transport): the learner pushes",
    )
    w.add_argument("--base-every", type=int, metavar="N", help="a full base every N versions (default 10)")
    w.add_argument(
        "--encode-gb-per-s",
        type=float,
        metavar="X",
        help="delta encode, full bf16 GB/s per core (default 1.0, bench/weight_delta.py)",
    )
    w.add_argument(
        "--decode-gb-per-s",
        type=float,
        metavar="X",
        help="delta decode, full bf16 GB/s per core (default 3.0, bench/weight_delta.py)",
    )
    w.add_argument("--codec-cores", type=int, metavar="N", help="cores the encode and each decode use (default 1)")


def _counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got {text!r}") from None


def _fanout(text: str) -> int:
    if text.strip().lower() == "push":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0, 'push' or a fan-out >= 2, got {text!r}") from None


def _weight_flags(args: argparse.Namespace) -> dict:
    from tether.commands.plan.rates import WEIGHT_FLAGS

    return {name: getattr(args, name) for name in WEIGHT_FLAGS if getattr(args, name) is not None}


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{flag}: expected non-negative numbers, got {text!r}")
    return values


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=1, default=str) + "\n")


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.from_run:
        return _plan_from_run(args, overrides)
    configs = args.config or [None]
    if len(configs) > 1:
        return _plan_runs(args, overrides)
    if args.fleet_slots is not None:
        raise ConfigError("--fleet-slots is the shared fleet's: give it with several --config")
    if args.learner_gpus and len(args.learner_gpus) > 1:
        raise ConfigError(f"--learner-gpus: one number for one --config, got {len(args.learner_gpus)}")
    learner_gpus = args.learner_gpus[0] if args.learner_gpus else None
    cfg = load_config(configs[0], overrides)
    from tether.commands.plan.project import best_split, describe, project

    rates = _rates(args)
    if args.sweep:
        return _plan_sweep(args, cfg, rates, learner_gpus=learner_gpus)
    if args.total_gpus:
        best, tried = best_split(cfg, rates, total_gpus=args.total_gpus, learner_step=args.learner_step)
        for p in tried:
            print(f"  {p.learner_gpus:>5} learner + {p.rollout_gpus:>5} rollout: {p.sim.samples_per_s:,.1f} samples/s")
        print(f"best split of {args.total_gpus} GPUs at max_staleness {best.max_staleness}:")
        print(describe(best))
        _write_json(args.json, {"best": _as_json(best), "tried": [_as_json(p) for p in tried]})
        return 0
    if not (learner_gpus and args.rollout_gpus):
        raise ConfigError(
            "tether plan: give --from-run RUN_DIR, or --learner-gpus and --rollout-gpus, or "
            "--total-gpus, or --learner-gpus with --sweep"
        )
    p = project(cfg, rates, learner_gpus=learner_gpus, rollout_gpus=args.rollout_gpus)
    print(describe(p))
    _write_json(args.json, _as_json(p))
    return 0


def _plan_from_run(args: argparse.Namespace, overrides: list[str]) -> int:
    """--from-run: the finished run's measured figures next to what the simulator predicts for it."""
    if args.config or overrides or args.learner_gpus or args.rollout_gpus or args.total_gpus or args.sweep:
        raise ConfigError("--from-run takes the run's own config; leave out --config, GPU counts and overrides")
    if _weight_flags(args):
        raise ConfigError(
            f"--from-run replays the run's measured weight syncs; leave out "
            f"{', '.join('--' + k.replace('_', '-') for k in _weight_flags(args))}"
        )
    from tether.commands.plan.calibrate import calibrate, report

    cal = calibrate(args.from_run)
    print(report(cal))
    m, p = cal.measured, cal.predicted
    _write_json(
        args.json,
        {
            "measured": {**asdict(m), "staleness_mean": m.staleness_mean},
            "predicted": {
                **{k: v for k, v in asdict(p).items() if k != "step_times"},
                "staleness_mean": p.staleness_mean,
            },
            "rollout_tokens_per_s": cal.rollout_tokens_per_s,
        },
    )
    return 0


def _plan_sweep(args: argparse.Namespace, cfg: TetherConfig, rates: Rates, *, learner_gpus: int | None) -> int:
    """--sweep: splits × max_staleness, as a table (printed and in sweep.md) and a plot (sweep.png)."""
    from tether.commands.plan.project import sweep, sweep_plot, sweep_table

    if not learner_gpus:
        raise ConfigError("--sweep needs --learner-gpus (the ratios multiply it)")
    rows = sweep(
        cfg,
        rates,
        learner_gpus=learner_gpus,
        ratios=_numbers(args.ratios, float, "--ratios"),
        staleness=_numbers(args.staleness, int, "--staleness"),
    )
    out = Path(args.sweep)
    out.mkdir(parents=True, exist_ok=True)
    table = sweep_table(rows)
    (out / "sweep.md").write_text(table + "\n")
    png = sweep_plot(
        rows,
        out / "sweep.png",
        title=f"{rates.setting}; B={cfg.learner.train_batch_size}, "
        f"n={cfg.rollout.n}, max_tokens={cfg.rollout.max_tokens}",
    )
    print(table)
    print(f"wrote {out / 'sweep.md'} and {png}")
    _write_json(args.json, {"sweep": [_as_json(p) for p in rows]})
    return 0


def _rates(args: argparse.Namespace) -> Rates:
    from tether.commands.plan.rates import load_rates, weight_path, with_weight_flags

    rates = with_weight_flags(load_rates(args.rates), **_weight_flags(args))
    print(f"rates: {rates.setting} ({args.rates or 'configs/rates/h100-7b.yaml'}; sources in the file)")
    print(f"weight path simulated: {weight_path(rates).label()} (today's: push, full)")
    return rates


def _plan_runs(args: argparse.Namespace, overrides: list[str]) -> int:
    """Several --config: the runs on one rollout fleet."""
    if args.total_gpus or args.sweep:
        raise ConfigError("several --config share one fleet: give --learner-gpus and --rollout-gpus (--total-gpus "
                          "and --sweep take one --config)")  # fmt: skip
    if not (args.learner_gpus and args.rollout_gpus):
        raise ConfigError("several --config: give --learner-gpus (each run's) and --rollout-gpus (the fleet's)")
    learner_gpus = args.learner_gpus * len(args.config) if len(args.learner_gpus) == 1 else args.learner_gpus
    if len(learner_gpus) != len(args.config):
        raise ConfigError(
            f"--learner-gpus: one number for every run or one per --config ({len(args.config)}), "
            f"got {len(learner_gpus)}"
        )
    if args.fleet_slots is not None and args.fleet_slots < 1:
        raise ConfigError(f"--fleet-slots must be >= 1, got {args.fleet_slots}")
    stems = [Path(c).stem for c in args.config]
    names = stems if len(set(stems)) == len(stems) else [f"{i + 1}:{s}" for i, s in enumerate(stems)]
    configs = [(name, load_config(c, overrides)) for name, c in zip(names, args.config, strict=True)]
    from tether.commands.plan.runs import describe_runs, project_runs

    rates = _rates(args)
    p = project_runs(
        configs, rates, learner_gpus=learner_gpus, rollout_gpus=args.rollout_gpus, capacity=args.fleet_slots
    )
    print(describe_runs(p))
    r = p.result
    runs = [
        {"name": name, "share": share, "token_share": tokens, **_as_json(run)}
        for name, share, run, tokens in zip(p.names, p.shares, p.runs, r.token_share, strict=True)
    ]
    fleet = {"rollout_gpus": args.rollout_gpus, "capacity": p.capacity, "rollout_busy": r.rollout_busy,
             "decode_used": r.decode_used, "trajectory_mb_per_s": p.trajectory_mb_per_s}  # fmt: skip
    _write_json(args.json, {"fleet": fleet, "runs": runs})
    return 0


def _as_json(p: Projection) -> dict:
    s = p.sim
    return {
        "learner_gpus": p.learner_gpus,
        "rollout_gpus": p.rollout_gpus,
        "max_staleness": p.max_staleness,
        "samples_per_s": s.samples_per_s,
        "learner_idle": s.learner_idle,
        "sync_share": s.sync_share,
        "rollout_busy": s.rollout_busy,
        "staleness": s.staleness,
        "staleness_mean": s.staleness_mean,
        "trajectory_mb_per_s": p.trajectory_mb_per_s,
        "redis_mb_per_s": p.redis_mb_per_s,
        "redis_saturated": p.redis_saturated,
        "redis_memory_mb": p.redis_memory_mb,
        "redis_bound_mb": p.redis_bound_mb,
        "weight_sync": _cost_json(p.weight_sync),
        "weight_sync_full_push": _cost_json(p.full_push),
        "weight_sync_pull": _cost_json(p.pull),
    }


def _cost_json(c: SyncCost) -> dict:
    return {**asdict(c), "mode": c.mode, "codec_s": c.codec_s}
