"""The critic of PPO with GAE: a value model sharded like the actor, its values, its update, its metrics.

:class:`ValueModel` is a base transformer (by default the actor's, ``critic.model_path`` otherwise)
with a scalar head; the value of completion token ``j`` is read at the position that predicts it
(``prompt_len - 1 + j``, the state it was sampled from), the same positions whose logits the actor uses.
It is sharded by :func:`learner.parallelize.parallelize` with the critic's own gradient-checkpointing
switch. Values are computed by the learner on the current critic before each step: every rank scores
its share and one all-reduce gives every rank all values, so the advantages (which whiten over the
whole step) are the same on every rank. The critic never leaves the learner ranks; checkpoints hold it.

Metrics (verl's names): ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean`` (means over
the critic's updates), ``critic/vf_explained_var`` (of the step's values before the update against its
returns), ``critic/values/mean``, ``critic/returns/mean``, ``critic/grad_norm``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from learner import meta_init
from learner.losses import value_loss
from learner.packing import MicroBatch, Sample, make_micro_batch, per_token, plan_micro_batches
from learner.varlen_attention import cu_seqlens_kwargs
from tether.config import TetherConfig
from tether.logs import get_logger

log = get_logger(__name__)

_METRIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


class ValueModel(torch.nn.Module):
    """A transformer body with a scalar value head; ``forward`` returns the values at ``index`` ([N])."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.model = body
        self.config = body.config
        self._no_split_modules = body._no_split_modules  # parallelize finds the blocks by these names
        self.value_head = torch.nn.Linear(body.config.hidden_size, 1)
        # As a Hugging Face head (verl's critic is one): small, so the first values sit near 0, not at ±|h|.
        torch.nn.init.normal_(self.value_head.weight, std=getattr(body.config, "initializer_range", 0.02))
        torch.nn.init.zeros_(self.value_head.bias)

    def gradient_checkpointing_enable(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.model.gradient_checkpointing_enable(**kwargs)

    def forward(self, *, input_ids: Tensor, position_ids: Tensor, index: Tensor, **kwargs) -> Tensor:  # type: ignore[no-untyped-def]
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        # sum over the head's one output: its values, as a new tensor (FSDP warns about a returned view)
        return self.value_head(hidden.reshape(-1, hidden.shape[-1])[index]).sum(-1).float()


def load_value_model(cfg: TetherConfig, device: torch.device, *, meta: bool = False) -> ValueModel:
    """The critic's body from ``critic.model_path`` (or ``model.path``) in float32 on CPU, plus a fresh head.

    ``meta``: the body's parameters on the meta device, loaded shard by shard when it is sharded
    (:mod:`learner.meta_init`); the head is real from the start (a fresh init, not in the checkpoint)."""
    from transformers import AutoModel

    from learner.parallelize import attn_implementation

    path = cfg.critic.model_path or cfg.model.path
    kwargs = {
        "dtype": torch.float32,
        "attn_implementation": attn_implementation(cfg, device),
        "trust_remote_code": cfg.model.trust_remote_code,
    }
    body = meta_init.build(path, auto_class=AutoModel, **kwargs) if meta else AutoModel.from_pretrained(path, **kwargs)
    body.config.use_cache = False
    model = ValueModel(body)
    if meta:
        meta_init.mark(model, meta_init.pending(body))  # type: ignore[arg-type]
    return model


def critic_view(cfg: TetherConfig) -> TetherConfig:
    """The config :func:`learner.parallelize.parallelize` should see for the critic: its own switches."""
    learner = cfg.learner.model_copy(
        update={"enable_gradient_checkpointing": cfg.critic.enable_gradient_checkpointing, "use_liger": False}
    )
    return cfg.model_copy(update={"learner": learner})


def forward_values(model: torch.nn.Module, mb: MicroBatch, *, device: torch.device) -> Tensor:
    """Values of a micro-batch's completion tokens, [N] (an empty micro-batch gives a zero tied to every
    parameter, so the ranks' FSDP collectives still pair up)."""
    kwargs: dict = {}
    if mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask.to(device)
    elif not mb.empty:
        kwargs.update(cu_seqlens_kwargs(mb.seq_lengths, device))
    values = model(
        input_ids=mb.input_ids.to(device), position_ids=mb.position_ids.to(device), index=mb.logit_index.to(device),
        **kwargs,
    )  # fmt: skip
    return values * 0.0 if mb.empty else values


class Critic:
    """The sharded value model, its optimizer, and what a step does with them."""

    def __init__(self, cfg: TetherConfig, model: torch.nn.Module, *, device: torch.device) -> None:
        c = cfg.critic
        self.cfg, self.model, self.device = cfg, model, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=c.optim.lr,
            betas=cfg.learner.betas,
            eps=cfg.learner.eps,
            weight_decay=c.optim.weight_decay,
        )
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)

    def _plan(self, samples: list[Sample], index: list[int], *, forward_only: bool) -> list[list[int]]:
        c, lc = self.cfg.critic, self.cfg.learner
        plan = plan_micro_batches(
            [samples[i].length for i in index],
            world_size=self.world,
            dynamic=lc.use_dynamic_bsz,
            max_tokens=c.forward_max_token_len_per_gpu if forward_only else c.ppo_max_token_len_per_gpu,
            micro_batch_size=c.forward_micro_batch_size_per_gpu if forward_only else c.ppo_micro_batch_size_per_gpu,
            padded=not lc.use_remove_padding,
        )
        return [[index[j] for j in mb] for mb in plan[self.rank]]

    def _micro_batch(self, samples: list[Sample], index: list[int]) -> MicroBatch:
        return make_micro_batch(samples, index, packed=self.cfg.learner.use_remove_padding, pad_id=self.pad_id)

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> None:
        """Set every sample's ``values`` ([completion tokens]) from the current critic, on every rank."""
        offsets = np.concatenate([[0], np.cumsum([s.num_completion for s in samples])])
        flat = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=self.device)
        for index in self._plan(samples, list(range(len(samples))), forward_only=True):
            values = forward_values(self.model, self._micro_batch(samples, index), device=self.device)
            at = 0
            for i in index:
                n = samples[i].num_completion
                flat[offsets[i] : offsets[i] + n] = values[at : at + n]
                at += n
        dist.all_reduce(flat)  # each token is scored on exactly one rank; the others add zeros
        flat = flat.cpu().numpy()
        for i, s in enumerate(samples):
            s.values = flat[offsets[i] : offsets[i + 1]].copy()

    def update(self, samples: list[Sample], minis: list[list[int]]) -> dict[str, float]:
        """``critic.ppo_epochs`` passes of clipped value regression onto the samples' returns; the metrics."""
        c = self.cfg.critic
        sums = dict.fromkeys(_METRIC_KEYS, 0.0)
        norms = []
        for _ in range(c.ppo_epochs):
            for mini in minis:
                norms.append(self._update(samples, mini, sums))
        totals = torch.tensor([sums[k] for k in _METRIC_KEYS], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        out = {k: v / len(norms) for k, v in zip(_METRIC_KEYS, totals.tolist(), strict=True)}
        out["critic/grad_norm"] = sum(norms) / len(norms)
        out.update(value_metrics(samples))
        return out

    def _update(self, samples: list[Sample], mini: list[int], sums: dict[str, float]) -> float:
        g_tok = float(sum(samples[i].num_trained for i in mini))
        self.optimizer.zero_grad(set_to_none=True)
        for index in self._plan(samples, mini, forward_only=False):
            mb = self._micro_batch(samples, index)
            vpreds = forward_values(self.model, mb, device=self.device)
            if mb.empty:
                (vpreds.sum() * self.world).backward()
                continue
            dev = {"device": self.device}
            loss, m = value_loss(
                vpreds=vpreds,
                values=per_token(samples, index, "values").to(**dev),
                returns=per_token(samples, index, "returns").to(**dev),
                mask=per_token(samples, index, "loss_mask").to(**dev),
                seq_ids=mb.seq_ids.to(self.device),
                global_tokens=g_tok,
                global_seqs=float(len(mini)),
                cliprange_value=self.cfg.critic.cliprange_value,
                loss_agg_mode=self.cfg.critic.loss_agg_mode or self.cfg.algorithm.loss_agg_mode,
                norm_len=float(self.cfg.rollout.max_tokens),
            )
            (loss * self.world).backward()  # FSDP averages over ranks; the loss is already a global share
            for k, v in m.items():
                sums[k] += float(v)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.critic.grad_clip)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            log.warning("critic_update_skipped_nonfinite_grad", grad_norm=norm)
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def value_metrics(samples: list[Sample]) -> dict[str, float]:
    """Explained variance of the step's values (before the update) for its returns, and their means,
    over trained tokens: 1 - Var(R - V) / Var(R) (verl's ``critic/vf_explained_var``)."""
    mask = np.concatenate([s.loss_mask for s in samples]).astype(bool)
    values = np.concatenate([s.values for s in samples])[mask].astype(np.float64)
    returns = np.concatenate([s.returns for s in samples])[mask].astype(np.float64)
    return {
        "critic/vf_explained_var": float(1.0 - np.var(returns - values) / (np.var(returns) + 1e-5)),
        "critic/values/mean": float(values.mean()),
        "critic/returns/mean": float(returns.mean()),
    }


def build_critic(cfg: TetherConfig, device: torch.device) -> Critic | None:
    """The sharded critic when ``algorithm.adv_estimator`` needs one (``gae``), else None. What the critic
    needs from the rest of the config (no Ulysses sequence parallelism) was checked when it was loaded
    (:func:`tether.config.adv_estimator.check_estimator_needs`)."""
    from learner.parallelize import parallelize

    if not cfg.algorithm.estimator.needs_critic:
        return None
    view = critic_view(cfg)
    return Critic(cfg, parallelize(load_value_model(cfg, device, meta=True), view, device), device=device)
