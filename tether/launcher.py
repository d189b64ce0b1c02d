"""Launch commands for each process, and ``tether up``: the whole loop on one machine.

``tether up`` resolves the config (a fresh run id unless one is given), writes it to the run folder,
starts the embedded Redis when ``buffer.redis_url`` is empty, then the learner under torchrun and
``rollout.num_servers`` rollout servers, each logging JSON lines to ``{run}/logs/<name>.log`` (what
they print goes to ``<name>.out``). It returns when the
learner finishes; Ctrl-C or a crashed child stops everything (no orphan processes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tether.config import ConfigError, TetherConfig, save_resolved
from tether.logs import get_logger, setup_logging
from tether.resources import thread_env
from tether.runs import RunPaths, new_run_id, run_paths
from tether.supervisor import ChildFailed, ChildSpec, Supervisor

log = get_logger(__name__)


def learner_command(
    cfg: TetherConfig,
    *,
    config_path: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    nnodes: str = "1",
    node_rank: int = 0,
    rdzv_endpoint: str = "",
) -> list[str]:
    """``torchrun ... -m learner --config <resolved config>``: every rank reads the same file."""
    del config_path, overrides  # the resolved config already holds them
    resolved = save_resolved(cfg, run_paths(cfg).root)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.learner.nproc_per_node}"]
    if nnodes == "1" and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rdzv_endpoint}",
            f"--rdzv_id={cfg.run.run_id}",
        ]
    cmd += ["-m", "learner", "--config", str(resolved)]
    if resume:
        cmd.append("--resume")
    return cmd


def rollout_command(cfg: TetherConfig, *, index: int) -> list[str]:
    resolved = run_paths(cfg).config
    return [
        sys.executable,
        "-m",
        "rollout_server",
        "--config",
        str(resolved),
        "--rollout.server_id",
        f"rollout-{index}",
        "--run.seed",
        str(cfg.run.seed + 1000 * (index + 1)),
    ]


def check_model_path(cfg: TetherConfig) -> None:
    """Fail in a second, before any process starts, when the model folder is not there."""
    path = Path(cfg.model.path) if cfg.model.path else None
    if path is None or not (path / "config.json").exists():
        raise ConfigError(
            f"model.path: {cfg.model.path or '(empty)'} is not a Hugging Face model folder (no config.json) — "
            "point it at a local model, or make a tiny one with: tether make-tiny-model DIR"
        )


def save_buffer_stats(cfg: TetherConfig, paths: RunPaths) -> None:
    """Write the buffer's final books to ``{run}/buffer_stats.json`` (best effort, never fails the run)."""
    try:
        from buffer import RedisKeys, buffer_stats
        from tether.redis_server import connect_redis

        client = connect_redis(cfg.buffer.redis_url, timeout_s=2)
        stats = buffer_stats(client, RedisKeys(cfg.run.run_id))
        client.close()
        (paths.root / "buffer_stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    except Exception as e:  # diagnostics only
        log.warning("buffer_stats_not_saved", error=repr(e))


def up(cfg: TetherConfig, *, resume: bool = False) -> int:
    check_model_path(cfg)
    if cfg.run.run_id is None:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_id": new_run_id()})})
    paths: RunPaths = run_paths(cfg).make()
    setup_logging(
        process="up", level=cfg.run.log_level, console_format=cfg.run.log_format, log_file=paths.log_file("up")
    )
    from tether.redis_server import EmbeddedRedis

    embedded = None
    supervisor = Supervisor(grace_s=cfg.rollout.drain_timeout_s + 5)
    try:
        if not cfg.buffer.redis_url:
            embedded = EmbeddedRedis(paths.redis, appendonly=cfg.buffer.appendonly)
            url = embedded.start()
            cfg = cfg.model_copy(update={"buffer": cfg.buffer.model_copy(update={"redis_url": url})})
        save_resolved(cfg, paths.root)
        log.info("run_started", run_id=cfg.run.run_id, folder=str(paths.root))
        learner = learner_command(cfg, resume=resume)
        env = thread_env(cfg, "learner")
        supervisor.start(ChildSpec("learner", learner, paths.console_file("learner"), env=env, primary=True))
        env = thread_env(cfg, "rollout")
        for i in range(cfg.rollout.num_servers):
            name = f"rollout-{i}"
            supervisor.start(ChildSpec(name, rollout_command(cfg, index=i), paths.console_file(name), env=env))
        from tether.status import ProgressLine

        progress = ProgressLine(cfg)
        try:
            supervisor.wait(on_tick=progress.update)
        finally:
            progress.close()
        log.info("run_finished", run_id=cfg.run.run_id, folder=str(paths.root))
        if paths.metrics.exists():
            from tether.plots import plot_metrics

            png = plot_metrics(paths.metrics, paths.plots / "curves.png")
            if png is not None:
                print(f"tether: training curves in {png}", file=sys.stderr)
        return 0
    except ChildFailed as e:
        log.error("child_failed", child=e.name, code=e.code, log=str(e.log_file))
        print(f"tether: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntether: interrupted — stopping all processes", file=sys.stderr)
        return 130
    finally:
        supervisor.stop_all()
        if cfg.buffer.redis_url:
            save_buffer_stats(cfg, paths)
        if embedded is not None:
            embedded.stop()
