"""One learner step on a list of groups: samples → forward-only passes → mini-batch updates → metrics.

Independent of Redis and of weight sync, so tests drive it with fixed batches (the 1-vs-2-rank and the
checkpoint/resume equivalences). Every rank holds the same groups and derives the same plan, so the
only collectives are FSDP's own, the gradient-norm reduction inside ``clip_grad_norm_`` and one
all-reduce of the metrics (on one rank neither: :func:`clip_grad_norm`, :class:`MetricSums`).

The advantage estimator (:mod:`learner.advantages`) declares what it reads beside the rewards: with a
critic (``algorithm.adv_estimator: gae``) a step first scores the samples with it, with a reference model
it first runs the reference's forward-only pass; then the estimator, the critic's update, and the actor's
unless the critic is still warming up (``critic.critic_warmup``). The policy loss gets each micro-batch's
tensors as one :class:`learner.losses.PolicyLossInputs`, built in one place (:meth:`Trainer._loss_inputs`).

Losses are scaled by the world size before backward because FSDP2 averages gradients over ranks while
:mod:`learner.losses` already normalises by the global token/sequence counts. With Ulysses sequence
parallelism (:mod:`learner.ulysses`) the plan is made for the W/SP data-parallel groups: the SP ranks of a
group train the same micro-batches, each on its slice of the row, and only the group's first rank counts
the metrics.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from learner import ulysses, varlen_attention
from learner.advantages import assign_advantages, get_estimator
from learner.batch import NOT_SKIPPED, build_samples
from learner.critic import Critic
from learner.logprobs import dummy_loss, forward_micro_batch
from learner.losses import PolicyLossInputs, get_policy_loss
from learner.offload import activation_offload
from learner.optim import build_optimizer
from learner.packing import (
    MicroBatch,
    Sample,
    make_micro_batch,
    per_token,
    plan_micro_batches,
    plan_within_ranks,
    row_tokens,
    shared_prompt_units,
)
from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.trajectory import GroupData

log = get_logger(__name__)


def lr_lambda(cfg: TetherConfig, updates_per_step: int):
    """Linear warmup, then constant or cosine to ``min_lr_ratio``; counted in optimizer updates."""
    lc = cfg.learner
    warm, total = lc.lr_warmup_steps * updates_per_step, lc.total_steps * updates_per_step

    def fn(update: int) -> float:
        if update < warm:
            return (update + 1) / warm
        if lc.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (update - warm) / max(1, total - warm))
        return lc.min_lr_ratio + (1 - lc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def _temperatures(samples: list[Sample], index: list[int]) -> torch.Tensor | None:
    """Per-token sampling temperatures of a micro-batch; None when all are 1 (nothing to divide)."""
    if all(samples[i].temperature == 1.0 for i in index):
        return None
    return per_token(samples, index, "temperature")


def shares_prompts(cfg: TetherConfig, model: torch.nn.Module, ref_model: torch.nn.Module | None, *, sp: int) -> bool:
    """Whether micro-batches share their prompts (``learner.share_prompts``): packed rows, no sequence
    parallelism, and tether's split varlen kernel in every model that reads them. flash_attention_2 would
    take a completion for a sequence of its own; on the torch varlen kernel (GPU) the layout would run per
    prompt instead of in one launch, which has never been measured there, so those get a copy per sample."""
    models = [m for m in (model, ref_model) if m is not None]
    return (
        cfg.learner.share_prompts
        and cfg.learner.use_remove_padding
        and sp == 1
        and all(getattr(m.config, "_attn_implementation", None) == varlen_attention.VARLEN for m in models)
    )


def clip_grad_norm(model: torch.nn.Module, max_norm: float, *, world: int) -> torch.Tensor:
    """``clip_grad_norm_`` over the model's gradients; returns the total norm (a plain tensor).

    On one rank the FSDP2 gradients are DTensors on a one-rank mesh whose local tensors are the whole
    gradients: the same norm and the same scaling on those, as ``clip_grad_norm_`` computes them, skip
    DTensor dispatch and its no-op reductions — bit-identical, and about a tenth of the time at the demo size.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if world > 1 or not all(isinstance(p.grad, DTensor) for p in params):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    with torch.no_grad():
        grads = [p.grad.to_local() for p in params]
        norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))  # as clip_grads_with_norm_
    return norm


class MetricSums:
    """A step's loss metrics summed over micro-batches (maxima for keys ending ``_max``), kept as tensors.

    Each micro-batch adds its metrics without a host sync; :meth:`read` makes the step's only one (a
    ``.tolist()`` per kind) instead of a ``float()`` per metric and micro-batch — at the demo size those
    syncs and their dispatch were a visible share of the step. The sums are float64 and start at 0, in the
    order the micro-batches come, so the numbers are those of adding Python floats one by one.
    """

    def __init__(self, keys: list[str], device: torch.device) -> None:
        self.sum_keys = [k for k in keys if not k.endswith("_max")]
        self.max_keys = [k for k in keys if k.endswith("_max")]
        self.sums = torch.zeros(len(self.sum_keys), dtype=torch.float64, device=device)
        self.maxes = torch.zeros(len(self.max_keys), dtype=torch.float64, device=device)
        self.skipped = 0  # updates skipped for a non-finite gradient norm

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        zero = self.sums.new_zeros(())

        def stacked(keys: list[str]) -> torch.Tensor:
            return torch.stack([metrics[k].detach().to(zero) if k in metrics else zero for k in keys])

        if self.sum_keys:
            self.sums = self.sums + stacked(self.sum_keys)
        if self.max_keys:
            self.maxes = torch.maximum(self.maxes, stacked(self.max_keys))

    def read(self, n_updates: int) -> dict[str, float]:
        """Sums averaged over the step's updates, maxima as they are, the skip count when there was one."""
        out = {k: v / n_updates for k, v in zip(self.sum_keys, self.sums.tolist(), strict=True)}
        out.update(zip(self.max_keys, self.maxes.tolist(), strict=True))
        if self.skipped:
            out["learner/skipped_updates"] = float(self.skipped)
        return out


class Trainer:
    def __init__(
        self,
        cfg: TetherConfig,
        model: torch.nn.Module,
        *,
        device: torch.device,
        ref_model: torch.nn.Module | None,
        critic: Critic | None = None,
    ) -> None:
        lc = cfg.learner
        self.cfg, self.model, self.ref_model, self.critic, self.device = cfg, model, ref_model, critic, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.trained_samples: list[Sample] = []
        """The last step's samples as trained: advantages (and the critic's values) filled in, each knowing its
        group and trajectory (the viewer's record reads them)."""
        self.policy_loss = get_policy_loss(cfg.algorithm.policy_loss.loss_mode)
        self.estimator = get_estimator(cfg.algorithm.adv_estimator)
        # The config refused a run without what its estimator needs; a caller building the trainer by hand
        # hears it here rather than mid-step.
        name = cfg.algorithm.adv_estimator
        if self.estimator.needs_critic and critic is None:
            raise ValueError(
                f"adv_estimator {name!r} needs a critic: pass critic=learner.critic.build_critic(cfg, device)"
            )
        if self.estimator.needs_reference and ref_model is None:
            raise ValueError(f"adv_estimator {name!r} needs the reference model: pass ref_model (build_trainer "
                             "loads it when cfg.algorithm.uses_reference)")  # fmt: skip
        self.norm_len = float(cfg.rollout.max_tokens)  # Dr.GRPO's constant length
        self.offload = activation_offload(cfg, device)
        self.layout = ulysses.setup(lc.ulysses_sequence_parallel_size, num_heads=model.config.num_attention_heads)
        self.sp = self.layout if self.layout.sp > 1 else None
        mini = lc.ppo_mini_batch_size or lc.train_batch_size
        self.n_mini = lc.train_batch_size // mini
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, trainable)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.n_mini * lc.ppo_epochs))
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.share_prompts = shares_prompts(cfg, model, ref_model, sp=self.layout.sp)
        # The metric keys of one micro-batch, from an empty call: every rank reduces the same keys.
        _, m = self.policy_loss(PolicyLossInputs.empty(), cfg.algorithm)
        self.metric_keys = sorted(m)
        # One optimizer update per step: the policy cannot change before it, so the proximal log-probs
        # are the update's own forward, detached (as TRL and on-policy verl do). The separate forward-only
        # pass would cost a third of the step for the same numbers. False forces that pass (the reference
        # the equivalence test compares against).
        self.reuse_update_forward = True

    def separate_proximal_pass(self, n_minis: int) -> bool:
        """Whether proximal log-probs need their own forward-only pass before a step of ``n_minis`` updates."""
        if not self.cfg.algorithm.recompute_logprobs:
            return False
        one_update = n_minis == 1 and self.cfg.learner.ppo_epochs == 1
        return not (self.reuse_update_forward and one_update)

    @property
    def extra_forward_passes(self) -> int:
        """Forward-only passes over the batch a full step makes (proximal, reference): for the FLOPs count."""
        return int(self.separate_proximal_pass(self.n_mini)) + int(self.ref_model is not None)

    # ----- planning

    def _mini_batches(self, samples: list[Sample], n_groups: int) -> list[list[int]]:
        n = min(self.n_mini, max(1, n_groups))
        out: list[list[int]] = [[] for _ in range(n)]
        for i, s in enumerate(samples):
            out[s.group * n // max(1, n_groups)].append(i)
        return [m for m in out if m]

    def _plan(self, samples: list[Sample], index: list[int], *, forward_only: bool) -> list[list[list[int]]]:
        lc = self.cfg.learner
        budget = lc.max_token_len_per_gpu * self.layout.sp
        units, costs = self._units(samples, index, budget)
        plan = plan_micro_batches(
            costs,
            world_size=self.layout.dp,
            dynamic=lc.use_dynamic_bsz,
            max_tokens=budget,
            micro_batch_size=lc.micro_batch_size_per_gpu,
            padded=not lc.use_remove_padding,
        )
        return [[[i for u in mb for i in units[u]] for mb in rank] for rank in plan]

    def _units(self, samples: list[Sample], index: list[int], budget: int) -> tuple[list[list[int]], list[int]]:
        """What the planner places: a prompt's samples together where prompts are shared (token budgets
        only), otherwise each sample alone."""
        if self.share_prompts and self.cfg.learner.use_dynamic_bsz:
            return shared_prompt_units(samples, index, budget)
        return [[i] for i in index], [samples[i].length for i in index]

    def _forward_only_plan(self, samples: list[Sample], update_plans: list) -> list[list[int]]:
        """This rank's samples (the ones it updates on) cut by the larger forward-only budgets."""
        lc = self.cfg.learner
        budget = (lc.log_prob_max_token_len_per_gpu or 2 * lc.max_token_len_per_gpu) * self.layout.sp
        units: list[list[int]] = []
        costs: list[int] = []
        per_rank = []
        for r in range(self.layout.dp):
            mine = sorted({i for plan in update_plans for mb in plan[r] for i in mb})
            rank_units, rank_costs = self._units(samples, mine, budget)
            per_rank.append(list(range(len(units), len(units) + len(rank_units))))
            units += rank_units
            costs += rank_costs
        plan = plan_within_ranks(
            per_rank,
            costs,
            dynamic=lc.use_dynamic_bsz,
            max_tokens=budget,
            micro_batch_size=lc.log_prob_micro_batch_size_per_gpu or 2 * lc.micro_batch_size_per_gpu,
            padded=not lc.use_remove_padding,
        )
        return [[i for u in mb for i in units[u]] for mb in plan[self.layout.dp_rank]]

    # ----- passes

    def _micro_batch(self, samples: list[Sample], index: list[int]) -> MicroBatch:
        packed = self.cfg.learner.use_remove_padding
        return make_micro_batch(samples, index, packed=packed, pad_id=self.pad_id, share_prompts=self.share_prompts)

    @torch.no_grad()
    def _forward_only(self, model: torch.nn.Module, samples: list[Sample], plan: list[list[int]], field: str) -> None:
        for index in plan:
            mb = self._micro_batch(samples, index)
            if mb.empty:
                dummy_loss(model, mb, device=self.device)
                continue
            with spans.span("forward_only", field=field, rows=len(index)):
                logprobs, _ = forward_micro_batch(
                    model, mb, device=self.device, temperature=_temperatures(samples, index), sp=self.sp
                )
            logprobs = logprobs.cpu().numpy()
            offset = 0
            for i in index:
                n = samples[i].num_completion
                setattr(samples[i], field, logprobs[offset : offset + n])
                offset += n

    def _update(
        self,
        samples: list[Sample],
        mini: list[int],
        plan: list[list[int]],
        sums: MetricSums,
        *,
        proximal_from_forward: bool,
    ) -> float:
        """Gradient accumulation over this rank's micro-batches of one mini-batch, then one optimizer step.

        ``proximal_from_forward``: the proximal log-probs are this forward's own, detached (one update per step).
        """
        lc, a = self.cfg.learner, self.cfg.algorithm
        g_tok = float(sum(samples[i].num_trained for i in mini))
        g_seq = float(len(mini))
        self.optimizer.zero_grad(set_to_none=True)
        for index in plan:
            mb = self._micro_batch(samples, index)
            if mb.empty:
                with self.offload():
                    dummy = dummy_loss(self.model, mb, device=self.device)
                (dummy * self.world).backward()
                continue
            with self.offload(), spans.span("forward", rows=len(index)):
                logprobs, entropy = forward_micro_batch(
                    self.model,
                    mb,
                    device=self.device,
                    with_entropy=True,
                    chunked_entropy=lc.entropy_from_logits_with_chunking,
                    entropy_checkpointing=lc.entropy_checkpointing,
                    entropy_grad=a.entropy_coeff > 0,
                    temperature=_temperatures(samples, index),
                    sp=self.sp,
                )
            inputs = self._loss_inputs(
                samples, index, mb, logprobs, entropy, proximal_from_forward=proximal_from_forward,
                global_tokens=g_tok, global_seqs=g_seq,
            )  # fmt: skip
            loss, m = self.policy_loss(inputs, a)
            with spans.span("backward", rows=len(index)):
                (loss * self.world).backward()
            if not self.layout.sp_rank:  # the group's first rank counts its metrics
                sums.add(m)
        with spans.span("optimizer"):
            norm = float(clip_grad_norm(self.model, lc.grad_clip, world=self.world))
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                # The norm is global, so every rank skips together; nothing non-finite reaches the weights.
                log.warning("update_skipped_nonfinite_grad", grad_norm=norm)
                sums.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm

    def _loss_inputs(
        self,
        samples: list[Sample],
        index: list[int],
        mb: MicroBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        *,
        proximal_from_forward: bool,
        global_tokens: float,
        global_seqs: float,
    ) -> PolicyLossInputs:
        """The policy loss's inputs for one micro-batch: the forward's log-probs and entropy, the samples'
        per-token fields, the mini-batch's global counts. The one place a new loss input is filled."""

        def field(name: str) -> torch.Tensor:
            return per_token(samples, index, name).to(device=self.device)

        behavior = field("behavior_logprobs")
        if not self.cfg.algorithm.recompute_logprobs:
            proximal = behavior
        elif proximal_from_forward:
            proximal = logprobs.detach()
        else:
            proximal = field("proximal_logprobs")
        return PolicyLossInputs(
            logprobs=logprobs,
            proximal_logprobs=proximal,
            behavior_logprobs=behavior,
            advantages=field("advantage"),
            mask=field("loss_mask"),
            seq_ids=mb.seq_ids.to(self.device),
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            norm_len=self.norm_len,
            entropy=entropy,
            ref_logprobs=field("ref_logprobs") if self.ref_model is not None else None,
        )

    def _train_actor(
        self, samples: list[Sample], minis: list[list[int]], plans: list, *, have_ref: bool
    ) -> dict[str, float]:
        """Forward-only passes, then ``ppo_epochs`` over the mini-batches; the policy's metrics.
        ``have_ref``: the reference's log-probs are on the samples already (the estimator read them)."""
        separate = self.separate_proximal_pass(len(minis))
        ref_pass = self.ref_model is not None and not have_ref
        if separate or ref_pass:
            fplan = self._forward_only_plan(samples, plans)
            if separate:
                self._forward_only(self.model, samples, fplan, "proximal_logprobs")
            if ref_pass:
                self._forward_only(self.ref_model, samples, fplan, "ref_logprobs")
        sums = MetricSums(self.metric_keys, self.device)
        norms = []
        for _ in range(self.cfg.learner.ppo_epochs):
            for mini, plan in zip(minis, plans, strict=True):
                norms.append(
                    self._update(samples, mini, plan[self.layout.dp_rank], sums, proximal_from_forward=not separate)
                )
        n_updates = len(norms)
        if self.world > 1:  # one rank holds the totals already: no collective to wait for
            dist.all_reduce(sums.sums)
            dist.all_reduce(sums.maxes, op=dist.ReduceOp.MAX)
        out = sums.read(n_updates)
        out["actor/grad_norm"] = sum(norms) / n_updates
        return out

    def train_step(self, groups: list[GroupData], *, version: int, step: int = 0) -> dict[str, float]:
        """Train on one step's groups (``step``: steps done before this one); returns the step's metrics
        (identical on every rank)."""
        a = self.cfg.algorithm
        t0 = time.perf_counter()
        samples, skipped = build_samples(
            groups,
            current_version=version,
            max_len=self.cfg.model.max_model_len,
            default_temperature=self.cfg.rollout.temperature,
        )
        out = {f"learner/{k}" if k in NOT_SKIPPED else f"learner/skipped_{k}": float(v) for k, v in skipped.items()}
        self.trained_samples = samples
        if not any(s.num_trained for s in samples):
            log.warning("empty_batch_skipped", groups=len(groups))
            out["learner/empty_batches"] = 1.0
            return out
        # A fully masked sample stays in the step, as in verl: in its group's baseline and in the sequence
        # count of the seq-mean aggregations, with no token in the loss.
        if self.critic is not None:
            with spans.span("critic_values"):
                self.critic.compute_values(samples)
        minis = self._mini_batches(samples, len(groups))
        plans = [self._plan(samples, m, forward_only=False) for m in minis]
        if self.estimator.needs_reference:  # the estimator reads the reference's log-probs
            self._forward_only(self.ref_model, samples, self._forward_only_plan(samples, plans), "ref_logprobs")
        assign_advantages(samples, a)
        if self.critic is not None:
            with spans.span("critic_update"):
                out.update(self.critic.update(samples, minis))
        if self.critic is None or step >= self.cfg.critic.critic_warmup:
            out.update(self._train_actor(samples, minis, plans, have_ref=self.estimator.needs_reference))
        else:
            out["actor/warmup"] = 1.0  # the critic's warm-up: the policy is not updated this step
        rewards = [s.reward for s in samples]
        stale = [s.staleness for s in samples]
        tokens = sum(s.length for s in samples)
        computed = sum(
            row_tokens(samples, mb, share_prompts=self.share_prompts) for plan in plans for rank in plan for mb in rank
        )
        out.update(
            {
                "actor/lr": self.scheduler.get_last_lr()[0],
                "reward/mean": sum(rewards) / len(rewards),
                "reward/max": max(rewards),
                "reward/min": min(rewards),
                "staleness/mean": sum(stale) / len(stale),
                "staleness/max": float(max(stale)),
                # policy versions that produced the trained data (oldest token of each sample)
                "data/version_min": float(version - max(stale)),
                "data/version_max": float(version - min(stale)),
                "data/groups": float(len(groups)),
                "response/length_mean": sum(s.num_completion for s in samples) / len(samples),
                "learner/samples": float(len(samples)),
                "learner/tokens": float(tokens),
                "learner/tokens_computed": float(computed),  # a shared prompt once per micro-batch
                "timing/compute": time.perf_counter() - t0,
            }
        )
        return out
