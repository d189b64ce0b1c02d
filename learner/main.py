"""The learner process: set up ranks, model, buffer feed; then step, publish, checkpoint, log.

    torchrun --nproc_per_node N -m learner --config runs/<run>/config.yaml [--resume]

Per step: rank 0 feeds prompts and reads ``train_batch_size`` groups, broadcasts them (protobuf bytes)
to every rank; all ranks train (:class:`learner.trainer.Trainer`); rank 0 acknowledges the groups after
the optimizer step; every ``weight_sync.sync_every`` steps all ranks publish the weights as version v+1
and rank 0 then records the version in Redis. With ``max_staleness`` ≥ 1 (and ``weight_sync.async_publish``)
the publication is packed at once and sent while the next step trains; it is waited for at the end of that
step (at most one in flight); admission counts from the version the servers hold, and the prompts a new
version allows are fed the moment its commit is over (from the publication thread).
Checkpoints every ``checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import time

import numpy as np
import redis
import torch
import torch.distributed as dist
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer.health import clear_run_end, publish_run_end
from buffer.keys import RedisKeys
from buffer.ledger import write_books
from learner.batch import broadcast_groups
from learner.checkpoint import TrainState, export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.critic import build_critic
from learner.feed import DataTimeout, Feed
from learner.group_trace import GroupTrace
from learner.lifecycle import StopSignal, plan_resume_version
from learner.lora import adapter_params, is_lora
from learner.parallelize import load_actor, load_model, parallelize
from learner.telemetry import LiveStatus, StepProfiler, nvtx, peak_flops, train_flops
from learner.trainer import Trainer
from tether.config import TetherConfig
from tether.logs import get_logger, setup_logging
from tether.metrics import MetricsLogger, build_metrics
from tether.plots import write_plot
from tether.runs import run_paths

log = get_logger(__name__)

# Rank 0's word to every rank with each batch: train it, stop on a failure, or stop because asked to.
_GO_ON, _FAILED, _STOP_ASKED = 0, 1, 2


def init_distributed(cfg: TetherConfig) -> tuple[int, int, torch.device]:
    """torchrun's environment, or a 1-process group when started without torchrun."""
    if "RANK" not in os.environ:
        from tether.redis_server import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    want = cfg.learner.device
    cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("learner.device is cuda but no GPU is visible — set learner.device: cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: TetherConfig, *, resume: bool = False) -> int:
    rank, world, device = init_distributed(cfg)
    paths = run_paths(cfg)
    setup_logging(
        process=f"learner-rank{rank}",
        level=cfg.run.log_level,
        console_format=cfg.run.log_format,
        log_file=paths.log_file(f"learner-rank{rank}"),
    )
    try:
        return _run(cfg, rank=rank, world=world, device=device, resume=resume)
    finally:
        dist.destroy_process_group()


def _run(cfg: TetherConfig, *, rank: int, world: int, device: torch.device, resume: bool) -> int:
    lc = cfg.learner
    paths = run_paths(cfg)
    if rank == 0:
        paths.make()
    seed_everything(cfg.run.seed)
    model = parallelize(load_actor(cfg, device), cfg, device)
    ref = parallelize(load_model(cfg, device), cfg, device, trainable=False) if cfg.algorithm.use_kl_loss else None
    critic = build_critic(cfg, device)  # PPO with GAE: a value model that never leaves the learner
    trainer = Trainer(cfg, model, device=device, ref_model=ref, critic=critic)
    state = TrainState()
    if resume:
        ckpt = latest_checkpoint(paths.checkpoints)
        if ckpt is None:
            log.warning("resume_without_checkpoint", folder=str(paths.checkpoints))
        else:
            state = load_checkpoint(ckpt, model=model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                                    critic=critic)  # fmt: skip

    from buffer import ServerRegistry, publish_version, read_version
    from buffer.ledger import LedgerSnapshot, take_snapshot
    from weight_sync.sender import WeightSender
    from weight_sync.snapshot import latest_snapshot

    client = feed = live = evaluator = trace = None
    metrics: MetricsLogger = build_metrics(paths.root, rank=rank, tensorboard=cfg.run.tensorboard)
    republish = False
    if rank == 0:
        from tether.redis_server import connect_redis

        if not cfg.buffer.redis_url:
            raise ValueError("buffer.redis_url is empty: start the learner with `tether up`, or give a Redis URL")
        client = connect_redis(cfg.buffer.redis_url)
        if resume:
            snap = latest_snapshot(paths.snapshots)
            plan = plan_resume_version(state.version, published=read_version(client, RedisKeys(cfg.run.run_id)),
                                       snapshot=snap[0] if snap else None)  # fmt: skip
            log.info("resume_version", checkpoint=state.version, version=plan.version, publish=plan.publish,
                     reason=plan.reason)  # fmt: skip
            state.version, republish = plan.version, plan.publish
        feed = Feed(cfg, client, data_position=state.data_position, step=state.step, version=state.version,
                    ledger=LedgerSnapshot.from_json(state.ledger))  # fmt: skip
        clear_run_end(client, feed.keys)  # a resumed run is not over, whatever a lifetime before published
        live = LiveStatus(client=client, key=feed.keys.learner, port=lc.metrics_port, total_steps=lc.total_steps,
                          start_step=state.step)  # fmt: skip
        trace = GroupTrace(paths.root / "groups.jsonl")
    state.version, republish = _agree_version(state.version, republish, device)
    registry = ServerRegistry(client, feed.keys) if rank == 0 else None
    params = adapter_params(model) if is_lora(model) else None  # LoRA: updates carry the adapters only
    sender = WeightSender(cfg, model=model, params=params, rank=rank, world_size=world, registry=registry)
    if republish:  # before any prompt is fed: every server generates from the checkpoint's weights
        sender.publish(state.version, snapshot=True)
    if rank == 0 and (republish or read_version(client, feed.keys) < state.version):
        publish_version(client, feed.keys, state.version)
    if rank == 0 and lc.val_data_path:
        from learner.evaluation import Evaluator

        evaluator = Evaluator(cfg, client, feed.keys, metrics)
        evaluator.maybe_start(state.step, state.version)  # val_before_train
    profiler = StepProfiler(lc.profile.steps, paths.root / "profile", rank)
    n_params = sum(p.numel() for p in model.parameters())
    peak = peak_flops(device)
    forward_passes = trainer.extra_forward_passes
    saved_at = state.step if resume else -1
    stop_signal = StopSignal()
    code = 0

    def checkpoint() -> None:
        _sync_position(state, device)
        if rank == 0:
            try:
                state.ledger = take_snapshot(client, feed.keys).to_json()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # The weights are still worth keeping; a resume onto a Redis that lost the run then has no
                # books to restore, and says so.
                log.warning("checkpoint_without_books", error=str(e))
                state.ledger = None
        save_checkpoint(paths.checkpoints, model=model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                        state=state, critic=critic)  # fmt: skip

    # Off the critical path when the bound allows: version v+1 is sent while step v+2 trains. Its step's
    # metrics row waits for it (logged once its report is in), so every row still carries its own update.
    background_ok = cfg.weight_sync.async_publish and cfg.algorithm.max_staleness >= 1
    published = state.version  # the newest version the servers are known to hold (admission counts from it)
    pending: tuple[int, dict[str, float]] | None = None  # (step, metrics) of the publication in flight

    def committed(report: dict[str, float]) -> None:
        """On the publication thread, the moment the servers hold the version: record it, and admit the
        prompts it allows right away (in sync mode that happens before the next step, so must this)."""
        nonlocal published
        published = int(report["weight_sync/version"])
        publish_version(client, feed.keys, published)
        try:
            feed.feed(published)
        except redis.RedisError as e:  # the next read feeds again; nothing is lost by waiting for it
            log.warning("redis_unavailable", during="feed after publish", error=str(e))

    def servers_version() -> int:
        return published

    def settle() -> float:
        """Wait for the publication in flight (if any), log its step's row; seconds waited."""
        nonlocal pending
        if pending is None:
            return 0.0
        start = time.perf_counter()
        report = sender.wait()
        waited = time.perf_counter() - start
        step, row = pending
        pending = None
        if rank == 0:
            row.update(report)
            metrics.log(row, step=step)
        return waited

    try:
        while state.step < lc.total_steps:
            t0 = time.perf_counter()
            batch, stop = [], _GO_ON
            if rank == 0:
                try:
                    batch = feed.next_batch(
                        state.version,
                        stop_requested=lambda: stop_signal.requested,
                        admission_version=servers_version,
                    )
                except DataTimeout as e:
                    log.error("data_timeout", error=str(e))
                    stop = _FAILED
                if stop == _GO_ON and stop_signal.requested:
                    stop = _STOP_ASKED
            groups, stop = broadcast_groups([b.group for b in batch], device=device, stop=stop)
            if stop != _GO_ON:
                code = 1 if stop == _FAILED else 0
                break
            t_data = time.perf_counter() - t0
            with profiler(state.step + 1), nvtx(f"step{state.step + 1}"):
                out = trainer.train_step(groups, version=state.version, step=state.step)
            if rank == 0:
                feed.ack(batch)  # after the optimizer step that used them
                trace.write(batch, step=state.step + 1)
                state.data_position = feed.position
                out.update(feed.admission_metrics(published))
            state.step += 1
            t_sync = time.perf_counter()
            out["timing/weight_sync_wait"] = settle()  # the previous step's publication, sent meanwhile
            checkpoint_due = bool(lc.checkpoint_every) and state.step % lc.checkpoint_every == 0
            background = False
            if state.step % cfg.weight_sync.sync_every == 0:
                # The last step's and a checkpoint's publication complete first: the run's end, and a
                # checkpoint's version, must be what Redis and the snapshots say.
                background = background_ok and state.step < lc.total_steps and not checkpoint_due
                with nvtx("weight_sync"):
                    report = sender.publish(
                        state.version + 1, background=background, on_done=committed if rank == 0 else None
                    )
                state.version += 1
                if rank == 0 and not background:
                    published = state.version
                    publish_version(client, feed.keys, state.version)
                    out.update(report)
            t_sync = time.perf_counter() - t_sync
            compute = out.get("timing/compute", 0.0)
            tokens = out.get("learner/tokens", 0.0)
            out.update(
                {
                    "timing/wait_data": t_data,
                    "timing/weight_sync": t_sync,
                    "timing/step": time.perf_counter() - t0,
                    "perf/tokens_per_s": tokens / compute if compute else 0.0,
                    "learner/version": float(state.version),
                    "learner/data_position": float(state.data_position),
                }
            )
            if peak and compute:
                flops = train_flops(n_params, int(tokens) * lc.ppo_epochs, forward_passes=forward_passes)
                out["perf/mfu"] = flops / (compute * peak * world)
            if background:
                pending = (state.step, out)
            elif rank == 0:
                metrics.log(out, step=state.step)
            if rank == 0:
                live.update(state.step, state.version, out)
                if evaluator is not None:  # asynchronous: results of earlier rounds are logged as they arrive
                    evaluator.poll()
                    # The version the servers hold: one behind the learner's while a publication is in flight.
                    evaluator.maybe_start(state.step, published)
            if checkpoint_due:
                checkpoint()
                saved_at = state.step
        settle()
        finished = code == 0 and state.step >= lc.total_steps
        if finished and evaluator is not None:
            evaluator.finish()
        # Finished, or stopped by a signal between steps: either way the state is whole, so keep it.
        if code == 0 and saved_at != state.step and state.step > 0:
            checkpoint()
        if finished and lc.export_hf:
            export_hf(model, out_dir=paths.root / "final", source_dir=cfg.model.path)
        if rank == 0 and code == 0 and state.step >= lc.total_steps:
            try:  # rollout servers started by hand idle or exit (rollout.exit_when_run_ends)
                publish_run_end(client, feed.keys, step=state.step, version=state.version)
            except redis.RedisError as e:
                log.warning("run_end_not_published", error=str(e))
    finally:
        stop_signal.restore()
        if pending is not None:  # a failing run still waits (bounded by the stage deadlines) and logs the row
            with contextlib.suppress(Exception):
                settle()
        sender.close()
        metrics.close()
        if live is not None:
            live.close()
        if rank == 0 and feed is not None:
            _write_books(cfg, feed.keys, paths.root / "buffer_stats.json")
        if rank == 0:
            write_plot(cfg, paths)  # also without `tether up` (which draws it again at its end)
    log.info("learner_finished", step=state.step, version=state.version, code=code, stopped_by=stop_signal.received)
    return code


def _write_books(cfg: TetherConfig, keys: RedisKeys, path) -> None:  # type: ignore[no-untyped-def]
    """The books at the learner's end, in every mode (also without ``tether up``); a fresh client with a short
    timeout, so a Redis that went away first cannot hold the exit up for the retry budget."""
    from tether.redis_server import RedisUnavailable, connect_redis

    try:
        client = connect_redis(cfg.buffer.redis_url, timeout_s=2.0)
    except RedisUnavailable as e:
        log.warning("buffer_books_not_saved", error=str(e))
        return
    client.set_retry(Retry(NoBackoff(), 0))
    write_books(client, keys, path)
    client.close()


def _agree_version(version: int, republish: bool, device: torch.device) -> tuple[int, bool]:
    """Rank 0 decided the resumed version; every rank must publish under the same one."""
    t = torch.tensor([version, int(republish)], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return int(t[0].item()), bool(t[1].item())


def _sync_position(state: TrainState, device: torch.device) -> None:
    """Only rank 0 knows the dataset position; every rank's checkpoint state must agree."""
    t = torch.tensor([state.data_position], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    state.data_position = int(t.item())
