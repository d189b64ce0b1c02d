"""The learner process: set up ranks, models, the buffer side and weight sync; then step, publish,
checkpoint, log.

    torchrun --nproc_per_node N -m learner --config runs/<run>/config.yaml [--resume]

Per step: rank 0 feeds prompts and reads ``train_batch_size`` groups, broadcasts them (their columnar
bytes as read) to every rank; all ranks train (:class:`learner.trainer.Trainer`); rank 0 acknowledges the groups after
the optimizer step; every ``weight_sync.sync_every`` steps all ranks publish the weights as version v+1
(:class:`learner.publish_schedule.PublishSchedule`: in the background while the next step trains when the
staleness bound allows) and rank 0 records the version in Redis. Checkpoints every ``checkpoint_every``
steps and at the end.

The set-up pieces live in files named for what they hold: the ranks in :mod:`learner.distributed`, rank 0's
Redis side in :mod:`learner.rank_zero`, publication in :mod:`learner.publish_schedule`, resume rules and the stop
signal in :mod:`learner.lifecycle`, step telemetry in :mod:`learner.telemetry`. This file is the order they
are built in and the loop.
"""

from __future__ import annotations

import gc
import sys
import time

import torch
import torch.distributed as dist

from learner.batch import broadcast_groups
from learner.checkpoint import TrainState, export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.critic import build_critic
from learner.distributed import agree_version, init_distributed, seed_everything, sync_position
from learner.lifecycle import StopSignal
from learner.parallelize import load_actor, load_model, parallelize
from learner.publish_schedule import PublishSchedule
from learner.rank_zero import CANNOT_TRAIN, FAILED, GO_ON, RankZero
from learner.telemetry import StepPerf, StepProfiler, nvtx
from learner.trainer import Trainer
from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger, setup_logging
from tether.plots import write_plot
from tether.runs import RunPaths, give_up, run_paths
from tether.trackers import TrackerUnavailable, build_metrics

log = get_logger(__name__)


def run(cfg: TetherConfig, *, resume: bool = False) -> int:
    rank, world, device = init_distributed(cfg)
    paths = run_paths(cfg)
    setup_logging(
        process=f"learner-rank{rank}",
        level=cfg.run.log_level,
        console_format=cfg.run.log_format,
        log_file=paths.log_file(f"learner-rank{rank}"),
    )
    spans.start(paths.spans, process=f"learner-rank{rank}", enabled=cfg.run.trace)
    try:
        return Learner(cfg, rank=rank, world=world, device=device, resume=resume).run()
    finally:
        # FSDP modules sit in reference cycles: freed now, not at interpreter shutdown, where a gloo thread
        # dropping a tensor's last reference without the GIL aborts the process after a successful run.
        spans.stop()
        gc.collect()
        dist.destroy_process_group()


def build_trainer(cfg: TetherConfig, device: torch.device) -> Trainer:
    """The actor (FSDP2), the frozen reference when the KL term or the estimator needs one, the critic when
    the estimator does."""
    # Built on the meta device: each rank loads only its own shards of model.path (learner.meta_init).
    model = parallelize(load_actor(cfg, device, meta=True), cfg, device)
    ref = None
    if cfg.algorithm.uses_reference:
        ref = parallelize(load_model(cfg, device, meta=True), cfg, device, trainable=False)
    critic = build_critic(cfg, device)  # PPO with GAE: a value model that never leaves the learner
    return Trainer(cfg, model, device=device, ref_model=ref, critic=critic)


def resume_state(paths: RunPaths, trainer: Trainer, *, resume: bool) -> TrainState:
    """The latest checkpoint's state (loading its weights, optimizer and critic), or a fresh one."""
    ckpt = latest_checkpoint(paths.checkpoints) if resume else None
    if ckpt is None:
        if resume:
            log.warning("resume_without_checkpoint", folder=str(paths.checkpoints))
        return TrainState()
    return load_checkpoint(ckpt, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                           critic=trainer.critic)  # fmt: skip


class Learner:
    """One learner rank's run: built in order, then :meth:`run` steps it to the end."""

    def __init__(self, cfg: TetherConfig, *, rank: int, world: int, device: torch.device, resume: bool) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.paths = paths = run_paths(cfg)
        if rank == 0:
            paths.make()
            paths.gave_up.unlink(missing_ok=True)  # an earlier lifetime's reason is not this one's
        seed_everything(cfg.run.seed)
        try:  # before the model loads: a tracker whose package is missing stops every rank in seconds
            self.metrics = build_metrics(paths.root, rank=rank, loggers=cfg.run.loggers, project=cfg.run.project_name,
                                         run_name=cfg.run.run_id, config=cfg.model_dump(mode="json"))  # fmt: skip
        except TrackerUnavailable as e:
            if rank == 0:
                give_up(paths, str(e))  # a restart cannot install a package: `tether up` ends the run
            raise
        self.trainer = build_trainer(cfg, device)
        self.state = state = resume_state(paths, self.trainer, resume=resume)
        # Rank 0 alone talks to Redis; on resume it picks the version to continue from, every rank agrees.
        self.zero = RankZero(cfg, paths, state, resume=resume) if rank == 0 else None
        republish = self.zero.republish if self.zero is not None else False
        state.version, republish = agree_version(state.version, republish, device)
        model = self.trainer.model
        self.publishing = PublishSchedule(cfg, model, rank=rank, world=world, zero=self.zero, metrics=self.metrics)
        self.publishing.start(state.version, republish=republish)
        if self.zero is not None and cfg.learner.val_data_path:
            self.zero.start_evaluation(self.metrics, step=state.step, version=state.version)
        self.profiler = StepProfiler(cfg.learner.profile.steps, paths.root / "profile", rank)
        self.perf = StepPerf(model, device=device, world=world, ppo_epochs=cfg.learner.ppo_epochs,
                             forward_passes=self.trainer.extra_forward_passes)  # fmt: skip
        self.saved_at = state.step if resume else -1
        self.stop_signal = StopSignal()

    def run(self) -> int:
        """Train, end the run (finished or stopped), and always close; the exit code."""
        try:
            code = self.train()
            self.finish(code)
        finally:
            self.close()  # the books and the plot first, whatever the ending
        if self.zero is not None and self.zero.cannot_train is not None:
            give_up(self.paths, self.zero.cannot_train)  # `tether up` ends the run rather than restart
            print(f"learner: error: {self.zero.cannot_train}", file=sys.stderr, flush=True)
        state = self.state
        log.info("learner_finished", step=state.step, version=state.version, code=code,
                 stopped_by=self.stop_signal.received)  # fmt: skip
        # The ranks leave together: torchrun stops every rank once one exits non-zero, which would cut rank 0
        # off while it still writes the books, the plot and why the run gave up (gave_up.txt, the error line).
        dist.barrier()
        return code

    def train(self) -> int:
        """Step until ``learner.total_steps`` or a stop; 0 when finished or asked to stop, 1 on a failure,
        :data:`CANNOT_TRAIN` (3) when the run cannot train (``learner.stuck_timeout_s``)."""
        lc, state, zero, publishing = self.cfg.learner, self.state, self.zero, self.publishing
        while state.step < lc.total_steps:
            t0 = time.perf_counter()
            batch, stop = [], GO_ON
            with spans.span("wait_data", step=state.step + 1):  # the buffer's groups, and the rank broadcast
                if zero is not None:  # admission counts from the version the servers hold, read when computed
                    batch, stop = zero.next_batch(state.version, self.stop_signal, lambda: publishing.published,
                                                  last=state.step + 1 >= lc.total_steps)  # fmt: skip
                groups, stop = broadcast_groups(
                    [b.group for b in batch], payloads=[b.columnar for b in batch], device=self.device, stop=stop
                )
            if stop != GO_ON:
                return {FAILED: 1, CANNOT_TRAIN: CANNOT_TRAIN}.get(stop, 0)
            t_data = time.perf_counter() - t0
            with self.profiler(state.step + 1), nvtx("train_step", step=state.step + 1):
                out = self.trainer.train_step(groups, version=state.version, step=state.step)
            if zero is not None:  # after the optimizer step that used them
                trained = self.trainer.trained_samples
                out.update(zero.trained(batch, trained, step=state.step + 1, version=state.version))
                state.data_position = zero.feed.position
            state.step += 1
            t_sync = time.perf_counter()
            out["timing/weight_sync_wait"] = publishing.settle()  # the previous step's publication, sent meanwhile
            checkpoint_due = bool(lc.checkpoint_every) and state.step % lc.checkpoint_every == 0
            background = False
            if state.step % self.cfg.weight_sync.sync_every == 0:
                # The last step's and a checkpoint's publication complete first: the run's end, and a
                # checkpoint's version, must be what Redis and the snapshots say.
                background = publishing.background_ok and state.step < lc.total_steps and not checkpoint_due
                out.update(publishing.publish(state.version + 1, background=background))
                state.version += 1
            out.update(self.perf.metrics(out, started=t0, wait_data=t_data, weight_sync=time.perf_counter() - t_sync))
            out.update({"learner/version": float(state.version), "learner/data_position": float(state.data_position)})
            publishing.log_row(state.step, out, background=background)
            if zero is not None:
                zero.after_step(state.step, state.version, out, servers_version=publishing.published)
            if checkpoint_due:
                self.checkpoint()
        return 0

    def checkpoint(self) -> None:
        """Every rank saves its shards; rank 0 adds the buffer's books, so a resume restores both."""
        state = self.state
        sync_position(state, self.device)
        if self.zero is not None:
            state.ledger = self.zero.books()
        t = self.trainer
        save_checkpoint(self.paths.checkpoints, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
                        state=state, critic=t.critic)  # fmt: skip
        self.saved_at = state.step

    def finish(self, code: int) -> None:
        """The run's end, finished or stopped between steps: the last publication lands, the final
        evaluation, a checkpoint (the state is whole either way), the export and the run-end mark."""
        lc, state, zero = self.cfg.learner, self.state, self.zero
        self.publishing.settle()
        finished = code == 0 and state.step >= lc.total_steps
        if finished and zero is not None and zero.evaluator is not None:
            zero.evaluator.finish()
        if code in (0, CANNOT_TRAIN) and self.saved_at != state.step and state.step > 0:
            self.checkpoint()  # between steps the state is whole: a resume after the fix loses no step
        if finished and lc.export_hf:
            export_hf(self.trainer.model, out_dir=self.paths.root / "final", source_dir=self.cfg.model.path)
        if finished and zero is not None:
            zero.mark_run_end(step=state.step, version=state.version)

    def close(self) -> None:
        """Whatever happened: signal handlers back, the publication in flight waited for, books and plot."""
        self.stop_signal.restore()
        self.publishing.close()
        self.metrics.close()
        if self.zero is not None:
            self.zero.close(self.paths)
        if self.rank == 0:
            write_plot(self.cfg, self.paths)  # also without `tether up` (which draws it again at its end)
