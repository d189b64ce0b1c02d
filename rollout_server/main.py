"""One rollout server process: engine, gRPC services, prompt worker, heartbeats, graceful drain.

    python -m rollout_server --config cfg.yaml --run.run_id r1 [--rollout.port 50051 ...]

Start-up order matters: the engine loads first (minutes for vLLM), and only then does the gRPC port
open and the registry heartbeat begin, so no client or learner ever sees a server that cannot serve.
SIGTERM (or Ctrl-C) drains: health turns NOT_SERVING, new RPCs get UNAVAILABLE, the prompt worker
takes no new prompt, in-flight work gets ``drain_timeout_s`` to finish (what does not finish stays
unacknowledged in the prompts stream for another server), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from typing import TYPE_CHECKING

from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger, setup_logging
from tether.redis_server import free_port

if TYPE_CHECKING:
    from rollout_server.engines import Engine
    from rollout_server.shares import ShareGate

log = get_logger(__name__)


def resolve_identity(cfg: TetherConfig) -> tuple[int, str]:
    """(port, server_id): port 0 becomes a free port now, so the id ("host-port") is known before the bind."""
    port = cfg.rollout.port or free_port(cfg.rollout.host if cfg.rollout.host not in ("", "0.0.0.0") else "127.0.0.1")
    return port, cfg.rollout.server_id or f"{socket.gethostname()}-{port}"


def run(cfg: TetherConfig) -> int:
    port, server_id = resolve_identity(cfg)
    log_file = None
    if cfg.run.run_id is not None:
        from tether.runs import run_paths

        log_file = run_paths(cfg).log_file(server_id)
    setup_logging(process=server_id, level=cfg.run.log_level, console_format=cfg.run.log_format, log_file=log_file)
    if cfg.run.run_id is not None:
        spans.start(run_paths(cfg).spans, process=server_id, enabled=cfg.run.trace)
    try:
        return asyncio.run(serve(cfg, port=port, server_id=server_id))
    except KeyboardInterrupt:
        return 130
    finally:
        spans.stop()


async def serve(
    cfg: TetherConfig,
    *,
    port: int,
    server_id: str,
    stop: asyncio.Event | None = None,
    gate: ShareGate | None = None,
    loading: asyncio.Lock | None = None,
    engine: Engine | None = None,
) -> int:
    """Serve one run until ``stop`` (SIGTERM / Ctrl-C when None). A fleet serving several runs in this
    process (``rollout_server.fleet``) passes its fair-share ``gate``, which this run's generations pass,
    and its ``loading`` lock: its engines load one at a time (two at once doubles the peak memory, and
    transformers' lazy imports are not safe on two threads: one slot got ``cannot import name
    'AutoModelForCausalLM'``), and, for a LoRA run on a base it shares with other runs, the run's
    ``engine`` (``rollout_server.engines.adapter_view.AdapterView``) instead of one of its own."""
    from rollout_server.control import ControlServicer
    from rollout_server.engines import build_engine
    from rollout_server.episodes import EpisodeStore
    from rollout_server.metrics import ServerMetrics
    from rollout_server.server import set_serving
    from rollout_server.state import ServerState
    from tether.resources import with_prompt_workers

    cfg = with_prompt_workers(cfg)  # "derive from the step" becomes a number before anything reads it
    if stop is None:  # a process of its own: SIGTERM / Ctrl-C drain; embedded callers pass their own event
        stop = _stop_on_signals()
    engine = engine or build_engine(cfg)
    log.info("engine_loading", engine=engine.name, model=cfg.model.path)
    async with loading or contextlib.nullcontext():
        await engine.start()
    state = ServerState(cfg, engine, server_id, ServerMetrics(server_id), share_gate=gate)
    state.metrics.watch_engine(engine.step_counts)
    state.sink = _connect_sink(cfg, server_id)
    control = ControlServicer(state)
    pulling = cfg.weight_sync.transport.pulled and state.sink is not None
    if not pulling:
        await _catch_up(control)
    episodes = EpisodeStore(state)
    server, health, host = _build_server(state, control, episodes, port)
    puller = None
    if pulling:  # versions published once, pulled from peers / relays / the learner (rollout_server/pull.py)
        from rollout_server.pull import start_puller

        puller = await start_puller(state)
    await server.start()
    door = await _open_door(state, episodes, host)
    await set_serving(health, True)
    if cfg.rollout.metrics_port is not None:
        state.metrics.serve(cfg.rollout.host, cfg.rollout.metrics_port)
    state.metrics.policy_version.set(engine.policy_version)
    tasks, worker_task = _start_tasks(state, control, episodes, puller, stop)
    _log_ready(state)

    await stop.wait()
    await _drain(state, health, worker_task, set_serving)
    await _shut_down(state, tasks=tasks, server=server, door=door, puller=puller)
    return 1 if worker_task is not None and _crashed(worker_task) else 0


def _stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and Ctrl-C set (where the loop can take signal handlers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def _build_server(state, control, episodes, port: int):  # type: ignore[no-untyped-def]
    """The gRPC server (not yet started), its health servicer and the host name it is reached at; the
    bound address goes into ``state.address``."""
    from rollout_server.server import build_grpc_server
    from rollout_server.service import RolloutServicer
    from tether.auth import auth_token

    rc = state.cfg.rollout
    server, bound, health = build_grpc_server(
        rollout=RolloutServicer(state, episodes),
        control=control,
        host=rc.host,
        port=port,
        max_message_bytes=rc.max_message_bytes,
        token=auth_token(rc.auth_token),
        tls_cert=rc.tls_cert,
        tls_key=rc.tls_key,
    )
    host = rc.host if rc.host not in ("", "0.0.0.0", "[::]") else socket.gethostname()
    state.address = f"{host}:{bound}"
    return server, health, host


def _start_tasks(state, control, episodes, puller, stop: asyncio.Event):  # type: ignore[no-untyped-def]
    """The background tasks (episode sweeper; with a buffer: heartbeat, weight puller) and the prompt
    worker's task (None without a buffer or with ``rollout.prompt_workers`` 0)."""
    tasks = [asyncio.create_task(episodes.sweep_forever(), name="episode-sweeper")]
    worker_task = None
    if state.sink is not None:
        tasks.append(asyncio.create_task(_heartbeat_forever(state, control, stop), name="heartbeat"))
        if puller is not None:
            tasks.append(asyncio.create_task(puller.run(stop), name="weight-puller"))
        if state.cfg.rollout.prompt_workers > 0:
            from rollout_server.worker import PromptWorker

            worker_task = asyncio.create_task(PromptWorker(state).run(), name="prompt-worker")
            worker_task.add_done_callback(lambda task: _worker_ended(task, stop))
    return tasks, worker_task


def _log_ready(state) -> None:  # type: ignore[no-untyped-def]
    rc = state.cfg.rollout
    log.info(
        "rollout_server_ready",
        address=state.address,
        engine=state.engine.name,
        server_id=state.server_id,
        prompt_workers=rc.prompt_workers if state.sink else 0,
        openai_address=state.openai_address or None,
        tls=bool(rc.tls_cert),
        threads=_torch_threads(),
    )


async def _shut_down(state, *, tasks, server, door, puller) -> None:  # type: ignore[no-untyped-def]
    """After the drain: stop the background tasks, the ports and the puller, leave the registry, stop the engine."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.stop(grace=1.0)
    if door is not None:
        await door.stop()
    if puller is not None:
        puller.close()
    if state.sink is not None:
        with contextlib.suppress(Exception):
            await state.sink.remove()
            if puller is not None:
                await state.sink.forget_weights()
        state.sink.close()
    await state.engine.shutdown()
    log.info("rollout_server_stopped", server_id=state.server_id, generated_tokens=state.metrics.total_tokens)


async def _open_door(state, episodes, host: str):  # type: ignore[no-untyped-def]
    """The OpenAI-compatible HTTP door when ``rollout.openai.port`` is set (None otherwise)."""
    rc = state.cfg.rollout
    if rc.openai.port is None:
        return None
    from rollout_server.openai_api.serve import OpenAIDoor

    door = OpenAIDoor(state, episodes, host=rc.host, port=rc.openai.port)
    state.openai_address = f"http://{host}:{await door.start()}/v1"
    return door


def _crashed(task: asyncio.Task) -> bool:
    return task.done() and not task.cancelled() and task.exception() is not None


def _worker_ended(task: asyncio.Task, stop: asyncio.Event) -> None:
    """A prompt worker that crashed stops the server (exit 1): serving on, heartbeat and all, would look
    alive to the learner and a supervisor while generating nothing (on a fleet: that run's slot only)."""
    if _crashed(task):
        log.error("prompt_worker_crashed", error=repr(task.exception()))
        stop.set()


async def _drain(state, health, worker_task, set_serving) -> None:  # type: ignore[no-untyped-def]
    timeout = state.cfg.rollout.drain_timeout_s
    log.info("draining", inflight=state.inflight, timeout_s=timeout)
    state.draining = True
    await set_serving(health, False)
    waits = [asyncio.create_task(state.idle.wait())]
    if worker_task is not None:
        waits.append(worker_task)  # type: ignore[arg-type]
    _done, pending = await asyncio.wait(waits, timeout=timeout)
    for t in pending:  # cut off: its prompts stay unacknowledged and are reclaimed by another server
        t.cancel()
    if pending:
        log.warning("drain_timeout", inflight=state.inflight, timeout_s=timeout)
    await asyncio.gather(*waits, return_exceptions=True)


def _torch_threads() -> int | None:
    """The engine's CPU thread count (``OMP_NUM_THREADS`` as torch took it): one process per core share."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _connect_sink(cfg: TetherConfig, server_id: str):  # type: ignore[no-untyped-def]
    if cfg.run.run_id is None or not cfg.buffer.redis_url:
        log.warning(
            "no_buffer",
            reason="run.run_id or buffer.redis_url is empty: serving gRPC only, no prompt worker, no episodes",
        )
        return None
    from rollout_server.sink import BufferSink

    return BufferSink(cfg, server_id)


async def _catch_up(control) -> None:  # type: ignore[no-untyped-def]
    """Load the newest filesystem snapshot before serving, when weight_sync is installed."""
    from rollout_server.validation import BadRequest

    try:
        receiver = control.receiver()
    except BadRequest as e:
        log.info("weight_sync_unavailable", reason=str(e))
        return
    try:
        version = await receiver.catch_up()
        log.info("caught_up", policy_version=version)
    except Exception as e:  # a missing or broken snapshot must not keep the server from serving version 0
        log.warning("catch_up_failed", error=str(e))


async def _check_run_end(state, stop: asyncio.Event, said: bool) -> bool:  # type: ignore[no-untyped-def]
    """The learner published the run's end: exit (``rollout.exit_when_run_ends``) or say once that we idle."""
    ended = await state.sink.run_ended()
    if ended is None:
        return False
    if state.cfg.rollout.exit_when_run_ends:
        log.info("run_ended_exiting", **ended)
        stop.set()
    elif not said:
        log.info("run_ended_idling", **ended, hint="the learner finished; pass --exit-when-run-ends to exit instead")
    return True


async def _heartbeat_forever(state, control, stop: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
    said_ended = False
    while True:
        try:
            await state.sink.heartbeat(
                address=state.address,
                engine=state.engine.name,
                policy_version=state.engine.policy_version,
                extra={
                    "running": state.engine.running_requests,
                    "draining": int(state.draining),
                    **({"openai_address": state.openai_address} if state.openai_address else {}),
                },
            )
            # A server the learner's update missed (it was not in the registry then — e.g. its entry had
            # expired over a Redis outage — or it missed a deadline) would otherwise stay behind until the
            # next update reaches it, producing groups the learner drops as stale; if the learner is
            # waiting for exactly those groups, that next update never comes. So whenever the published
            # version is ahead of ours, load the newest snapshot (catch_up is a no-op without one).
            pulls = state.cfg.weight_sync.transport.pulled  # the puller catches up by itself
            if not pulls and await state.sink.published_version() > state.engine.policy_version:
                await _catch_up(control)
            said_ended = await _check_run_end(state, stop, said_ended)
        except Exception as e:
            log.warning("heartbeat_failed", error=str(e))
        await asyncio.sleep(state.cfg.rollout.heartbeat_s)
