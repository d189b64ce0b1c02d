"""One rollout process serving several runs at once: ``tether rollout --runs a,b --config fleet.yaml``.

Each run gets a slot that is, to that run, one of its rollout servers (:func:`rollout_server.main.serve`):
its own engine holding its own copy of the weights (full fine-tuning) — or, for runs that fine-tune LoRA
adapters of one base, one engine they share, each run's rows generating with its own adapter
(:mod:`rollout_server.engines.adapter_view`) — its own gRPC port and registry entry
under the run's keys, its prompt worker, its weight updates. A slot is configured by the run's published
config (:mod:`buffer.run_config`: the run's model, sampling, reward, tasks, weight transport and share) with
the fleet's own engine, network, credentials and Redis. Prompts are admitted by each run's learner under
that run's ``max_staleness`` and version, as for any server of the run; trajectories go to the run's
stream with the run's policy versions; a run's weight update loads into its slot's engine only.

The slots share the process's cores (or GPU) through one fair-share gate (:mod:`rollout_server.shares`):
at most ``rollout.prompt_workers`` generations of the fleet config run at once, and under contention each
run gets generated tokens in proportion to its ``rollout.share``; a run with nothing to generate gives
its share to the others.

Isolation: a slot that fails (its model does not load, its engine dies) is logged and its share freed;
the others go on. A slot whose run ends stops (``rollout.exit_when_run_ends`` of the fleet config) or idles.
A slot waits for its run's learner to publish the config, so the fleet may start first. SIGTERM drains
every slot; the process exits 0 when every slot ended cleanly, 1 when one failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket

import structlog

from buffer.fleets import FleetState, forget_fleet, publish_fleet
from buffer.keys import RedisKeys
from buffer.run_config import asking_runs, read_run_config
from rollout_server.engines.adapter_view import AdapterView, SharedBase
from rollout_server.main import resolve_identity, serve
from rollout_server.shares import ShareGate
from tether.auth import auth_token, run_token
from tether.config import TetherConfig
from tether.logs import get_logger, setup_logging
from tether.redis_server import connect_redis

log = get_logger(__name__)

EVERY_RUN = "*"
"""``--runs '*'``: serve every run whose learner asks (publishes its config), joining new ones as they come."""

JOIN_POLL_S = 2.0
"""How often a fleet serving every run looks for new ones."""

STATE_KEYS = ("share", "tokens", "groups", "waiting", "inflight")
"""The gate's figures of each run a fleet publishes (``buffer.fleets``)."""

DEFAULT_CAPACITY = 4
"""Generations at once across the fleet's runs when the fleet config leaves ``rollout.prompt_workers`` empty."""

FLEET_ROLLOUT_KEYS = (
    "engine",
    "host",
    "auth_token",
    "tls_cert",
    "tls_key",
    "heartbeat_s",
    "drain_timeout_s",
    "exit_when_run_ends",
    "max_concurrent_requests",
    "max_message_bytes",
    "episode_idle_timeout_s",
)
"""The ``rollout`` keys a slot takes from the fleet's config (the machine's): every other key is the run's."""


def slot_config(fleet: TetherConfig, run_id: str, published: dict) -> TetherConfig:
    """The config one run's slot serves with: the run's published config, with the fleet's Redis, engine,
    network and credentials (:data:`FLEET_ROLLOUT_KEYS`), a free port and no metrics endpoint of its own.
    With a fleet token the slot's token is the run's own (:func:`tether.auth.run_token`). A run asking for
    ``model.trust_remote_code`` is refused unless the fleet's own config allows it (the model's code would run
    in the fleet's process, beside the other runs)."""
    body = {k: dict(v) if isinstance(v, dict) else v for k, v in published.items()}
    mine = fleet.model_dump(mode="json")
    body.setdefault("run", {})["run_id"] = run_id
    body.setdefault("buffer", {})["redis_url"] = fleet.buffer.redis_url
    rollout = body.setdefault("rollout", {})
    for key in FLEET_ROLLOUT_KEYS:
        rollout[key] = mine["rollout"][key]
    rollout.update(port=0, server_id="", metrics_port=None)
    if (body.get("model") or {}).get("trust_remote_code") and not fleet.model.trust_remote_code:
        raise ValueError(
            f"run {run_id!r} asks for model.trust_remote_code: a fleet runs no run's code unless its own config "
            "sets model.trust_remote_code: true"
        )
    secret = auth_token(fleet.rollout.auth_token)
    if secret:  # each run's slot takes that run's own token only (tether.auth.run_token)
        rollout["auth_token"] = run_token(secret, run_id)
    try:
        return TetherConfig.model_validate(body)
    except ValueError as e:
        raise ValueError(f"run {run_id!r}: its published config does not load here: {e}") from None


def capacity(fleet: TetherConfig) -> int:
    return fleet.rollout.prompt_workers or DEFAULT_CAPACITY


async def serve_runs(fleet: TetherConfig, run_ids: list[str], *, stop: asyncio.Event | None = None) -> int:
    """Serve ``run_ids`` — or, with ``["*"]``, every run that asks (:func:`buffer.run_config.asking_runs`,
    polled every :data:`JOIN_POLL_S`) — until ``stop`` (SIGTERM / Ctrl-C when None); listed runs: also until
    every slot has ended."""
    every = run_ids == [EVERY_RUN]
    if not run_ids or len(set(run_ids)) != len(run_ids) or (EVERY_RUN in run_ids and not every):
        raise ValueError(f"--runs: distinct run ids, or {EVERY_RUN!r} alone, expected; got {run_ids!r}")
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
    fleet_run = FleetProcess(fleet)
    try:
        return await fleet_run.run(run_ids, stop)
    finally:
        fleet_run.client.close()


class FleetProcess:
    """The slots of one fleet process, its gate, and its entry in Redis (``buffer.fleets``)."""

    def __init__(self, cfg: TetherConfig) -> None:
        self.cfg = cfg
        self.client = connect_redis(cfg.buffer.redis_url)
        self.gate, self.loading = ShareGate(capacity(cfg)), asyncio.Lock()
        self.fleet_id = cfg.rollout.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.slots: dict[str, tuple[asyncio.Task[int], asyncio.Event]] = {}  # each its own stop: a run's end is its own
        self.servers: dict[str, str] = {}  # run -> its slot's server id, while the slot serves
        self.shares: dict[str, dict] = {}  # run -> its gate figures when its slot ended
        self.codes: dict[str, int] = {}
        self.bases: dict[str, SharedBase] = {}  # a base model and engine settings -> the engine LoRA runs share

    async def run(self, run_ids: list[str], stop: asyncio.Event) -> int:
        every = run_ids == [EVERY_RUN]
        log.info("fleet_started", fleet_id=self.fleet_id, runs=run_ids, capacity=self.gate.capacity)
        beat = asyncio.create_task(self._heartbeat())
        try:
            for run in [] if every else run_ids:
                self.join(run)
            while not stop.is_set() and (every or not all(task.done() for task, _ in self.slots.values())):
                if every:
                    with contextlib.suppress(Exception):  # Redis away for a moment: the next poll joins them
                        for run in await asyncio.to_thread(asking_runs, self.client):
                            self.join(run)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=JOIN_POLL_S if every else 1.0)
            for _, own in self.slots.values():
                own.set()
            for run, (task, _) in self.slots.items():
                self.codes[run] = max(self.codes.get(run, 0), await task)
        finally:
            beat.cancel()
            with contextlib.suppress(Exception):
                forget_fleet(self.client, self.fleet_id)
        log.info("fleet_stopped", codes=self.codes, shares=self.shares)
        return 0 if all(code == 0 for code in self.codes.values()) else 1

    def join(self, run: str) -> None:
        if run in self.slots and not self.slots[run][0].done():
            return
        if run in self.slots:  # an earlier slot of this run ended (the run ended, then resumed): a new one
            self.codes[run] = max(self.codes.get(run, 0), self.slots[run][0].result())
        own = asyncio.Event()
        self.slots[run] = (asyncio.create_task(self._slot(run, own)), own)

    def _adapter_view(self, cfg: TetherConfig, run_id: str) -> AdapterView | None:
        """A LoRA run's engine on the base it shares with the fleet's other LoRA runs of that model (one engine
        loads it once; each run's rows carry its own adapter); None: the slot loads an engine of its own
        (full fine-tuning, ``modules_to_save``, or an engine without per-row adapters)."""
        lora, engine = cfg.model.lora, cfg.rollout.engine
        if lora is None or lora.modules_to_save or not engine.shares_base:
            return None
        limit = getattr(engine, "max_lora_rank", None)  # vLLM sizes its LoRA buffers at start
        if limit is not None and lora.rank > limit:
            return None
        model = cfg.model.model_dump(mode="json", exclude={"lora"})
        key = json.dumps([model, cfg.rollout.engine.model_dump(mode="json")], sort_keys=True)
        if key not in self.bases:
            from rollout_server.engines import build_engine

            self.bases[key] = SharedBase(build_engine(cfg, named_adapters=True))
        return AdapterView(self.bases[key], run_id)

    def state(self) -> FleetState:
        stats = self.gate.stats()
        runs = {run: {**{k: stats[run][k] for k in STATE_KEYS if k in stats.get(run, {})}, "server_id": sid}
                for run, sid in self.servers.items()}  # fmt: skip
        return FleetState(self.fleet_id, socket.gethostname(), self.gate.capacity, runs)

    async def _heartbeat(self) -> None:
        every = self.cfg.rollout.heartbeat_s
        while True:
            try:
                await asyncio.to_thread(publish_fleet, self.client, self.state(), ttl_s=3 * every)
            except Exception as e:
                log.warning("fleet_heartbeat_failed", error=str(e))
            await asyncio.sleep(every)

    async def _slot(self, run_id: str, stop: asyncio.Event) -> int:
        """One run's slot from its published config to its end."""
        # This task's context (a copy: the other slots keep theirs) and every task the slot starts: each of
        # its log lines names the run, as the fleet's one log interleaves several runs.
        structlog.contextvars.bind_contextvars(run=run_id)
        keys, said, published = RedisKeys(run_id), False, None
        while published is None and not stop.is_set():
            try:
                published = await asyncio.to_thread(read_run_config, self.client, keys)
            except Exception as e:  # Redis away for a moment, or a config that is not JSON: say so, retry
                log.warning("fleet_run_config_unreadable", run=run_id, error=str(e))
            if published is None:
                if not said:
                    log.info("fleet_waiting_for_run", run=run_id, hint="its learner publishes its config at start")
                    said = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
        if published is None:
            return 0  # stopped before the run started
        try:
            cfg = slot_config(self.cfg, run_id, published)
            port, server_id = resolve_identity(cfg)
        except (ValueError, OSError) as e:  # a config this fleet cannot serve, or no port: this run only
            log.error("fleet_run_refused", run=run_id, error=str(e))
            return 1
        self.gate.add_run(run_id, cfg.rollout.share)
        self.servers[run_id] = server_id
        engine = self._adapter_view(cfg, run_id)
        log.info("fleet_run_joined", run=run_id, server_id=server_id, share=cfg.rollout.share, model=cfg.model.path,
                 engine=cfg.rollout.engine.type, shared_base=engine is not None)  # fmt: skip
        try:
            return await serve(cfg, port=port, server_id=server_id, stop=stop, gate=self.gate, loading=self.loading,
                               engine=engine)  # fmt: skip
        except Exception as e:  # this run's slot only: the others go on
            log.exception("fleet_run_failed", run=run_id, error=str(e))
            return 1
        finally:
            self.shares[run_id] = self.gate.stats().get(run_id, {})
            self.servers.pop(run_id, None)
            self.gate.remove_run(run_id)


def run_fleet(fleet: TetherConfig, run_ids: list[str]) -> int:
    setup_logging(process=f"fleet-{socket.gethostname()}", level=fleet.run.log_level,
                  console_format=fleet.run.log_format)  # fmt: skip
    try:
        return asyncio.run(serve_runs(fleet, run_ids))
    except KeyboardInterrupt:
        return 130
