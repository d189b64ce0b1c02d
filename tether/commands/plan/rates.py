"""A rates file (``configs/rates/*.yaml``): what one GPU of each side does, with the sources it came from.

The planner turns a config, a GPU split and these rates into a :class:`tether.commands.plan.fleet.FleetSpec`:
rollout engines of ``tensor_parallel_size`` GPUs each decode ``tokens_per_s`` together (at most
``seq_tokens_per_s`` per sequence), each taking the groups tether's ``prompt_workers`` default gives it
(the step's prompts times ``max_staleness + 1`` over the servers, at most ``max_num_seqs // n``); the learner's
tokens/s grows with its GPUs times ``scaling_efficiency``; a weight update moves the bf16 weights at
``weight_sync.gb_per_s`` after a fixed handshake — pushed from the learner, or pulled by the fleet as deltas
(:mod:`tether.commands.plan.weights`; the ``weight_sync`` fields past ``latency_s``, each also a ``tether plan`` flag).
Every field is an input the user can replace with a figure measured on their own hardware
(``tether plan --from-run`` shows how to read them off a run).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError, field_validator

from tether.commands.plan import weights
from tether.commands.plan.fleet import FleetSpec, Lengths
from tether.commands.plan.weights import WeightPath, sync_cost
from tether.config import ConfigError, TetherConfig
from tether.config.base import Section
from tether.resources import prompt_workers

DEFAULT_RATES = Path(__file__).resolve().parents[3] / "configs" / "rates" / "h100-7b.yaml"

# Bytes per token in a trajectory group payload: int32 prompt ids; int32 ids, float32 log-prob, int32
# version and uint8 mask per completion token (tether/trajectory.py's dtypes); plus a per-sample allowance
# for the protobuf framing, reward, ids and metadata.
PROMPT_TOKEN_BYTES = 4
COMPLETION_TOKEN_BYTES = 13
SAMPLE_OVERHEAD_BYTES = 200


class RolloutRates(Section):
    tensor_parallel_size: int = 1
    """GPUs per rollout engine."""
    tokens_per_s: float
    """Completion tokens/s one engine decodes at its working batch (continuous batching)."""
    seq_tokens_per_s: float
    """Decode speed of one sequence (single stream): the ceiling for a group's longest sample."""
    max_num_seqs: int = 256
    """Sequences one engine batches (``rollout.engine.max_num_seqs``): at most max_num_seqs // n groups at once."""


class LearnerRates(Section):
    tokens_per_s_per_gpu: float
    """Learner tokens (prompt + completion) per second per GPU, forward + backward + the log-prob pass."""
    step_overhead_s: float = 0.0
    """Per step besides the tokens (optimizer step, collectives that do not overlap, bookkeeping)."""
    scaling_efficiency: float = 1.0
    """Fraction of linear scaling kept across learner GPUs."""


class SyncRates(Section):
    gb_per_s: float
    """Effective weight broadcast bandwidth, GB/s."""
    latency_s: float = 0.0
    """Fixed cost of one update (announce, pause, load, resume)."""
    delta_ratio: float | None = None
    """A version's bytes as a delta ÷ its full bf16 bytes; unset: 1.0 (full weights) for a push, the measured
    ``MEASURED_DELTA_RATIO`` (bench/weight_delta.py, lr 1e-6) for a pull."""
    fanout: int = 0
    """0 (or ``push``, the default, as ``weight_sync.transport`` defaults to a push): the learner pushes to
    every server; k >= 2: servers pull from peers in a k-ary tree (the ``store`` transport). The projection
    prints the other one beside it either way."""
    base_every: int = 10
    """A full base every this many versions (its bytes amortised over them; it travels the same path)."""
    encode_gb_per_s: float = weights.ENCODE_GB_PER_S
    """Delta encode on the learner's host, full bf16 GB/s per core (bench/weight_delta.py, 2-core CPU)."""
    decode_gb_per_s: float = weights.DECODE_GB_PER_S
    """Delta decode on each server, full bf16 GB/s per core (bench/weight_delta.py, 2-core CPU)."""
    codec_cores: int = 1
    """Cores the encode and each decode use at the per-core rates above (the store runs ``min(4, cpus)``
    threads, which gave 1.1–1.45× one thread's rate on the 2-core VM: memory-bound; 1 keeps the figure safe)."""

    @field_validator("fanout", mode="before")
    @classmethod
    def _push_is_zero(cls, value: object) -> object:
        return weights.PUSH if value == "push" else value


class RedisRates(Section):
    mb_per_s: float
    """Payload MB/s one Redis moves through put → read → ack (``bench/buffer.py``)."""
    source: str = ""


class WorkloadRates(Section):
    prompt_tokens: float
    completion_mean: float
    """Mean completion tokens before the ``rollout.max_tokens`` cap."""
    completion_cv: float = 0.5
    """Coefficient of variation of completion lengths (lognormal)."""


class Rates(Section):
    setting: str
    """What hardware and model class these rates describe."""
    sources: list[str]
    """Where each figure comes from (publications; derivations say so)."""
    model_params: float
    """Parameters of the policy (bf16 weights: 2 bytes each are synced)."""
    rollout: RolloutRates
    learner: LearnerRates
    weight_sync: SyncRates
    redis: RedisRates
    workload: WorkloadRates


def load_rates(path: str | Path | None) -> Rates:
    path = Path(path) if path else DEFAULT_RATES
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"--rates {path}: cannot read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--rates {path}: malformed YAML: {e}") from None
    try:
        return Rates.model_validate(data)
    except ValidationError as e:
        problems = [f"--rates {path}: {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ConfigError("\n".join(problems)) from None


WEIGHT_FLAGS = ("delta_ratio", "fanout", "base_every", "encode_gb_per_s", "decode_gb_per_s", "codec_cores")
"""``weight_sync`` fields ``tether plan`` takes as flags (``--delta-ratio`` ...)."""


def with_weight_flags(rates: Rates, **values: float | int | str | None) -> Rates:
    """``rates`` with the ``weight_sync`` fields given (not None) replaced, checked as a rates file's are."""
    given = {k: v for k, v in values.items() if v is not None}
    unknown = set(given) - set(WEIGHT_FLAGS)
    if unknown:
        raise ValueError(f"not weight-path flags: {sorted(unknown)}")
    if not given:
        return rates
    data = rates.model_dump()
    data["weight_sync"].update(given)
    try:
        out = Rates.model_validate(data)
    except ValidationError as e:
        flags = [f"--{'.'.join(map(str, err['loc'][1:])).replace('_', '-')}: {err['msg']}" for err in e.errors()]
        raise ConfigError("\n".join(flags)) from None
    weight_path(out)
    return out


def weight_path(rates: Rates) -> WeightPath:
    """The weight path the rates describe (a bad value is a :class:`ConfigError` naming its key and flag)."""
    ws = rates.weight_sync
    try:
        given = {name: getattr(ws, name) for name in WEIGHT_FLAGS}
        if given["delta_ratio"] is None:
            given["delta_ratio"] = 1.0 if given["fanout"] == weights.PUSH else weights.MEASURED_DELTA_RATIO
        return WeightPath(link_gb_per_s=ws.gb_per_s, latency_s=ws.latency_s, **given)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def full_bytes(rates: Rates) -> float:
    """The policy's bf16 weights."""
    return 2 * rates.model_params


def group_bytes(*, n: int, prompt_tokens: float, completion_tokens: float) -> float:
    """Payload bytes of one group in the trajectories stream (uncompressed)."""
    return n * (PROMPT_TOKEN_BYTES * prompt_tokens + COMPLETION_TOKEN_BYTES * completion_tokens + SAMPLE_OVERHEAD_BYTES)


def fleet_for(cfg: TetherConfig, rates: Rates, *, learner_gpus: int, rollout_gpus: int) -> FleetSpec:
    """The simulated fleet of ``cfg``'s protocol on ``learner_gpus`` + ``rollout_gpus`` GPUs at ``rates``."""
    tp = rates.rollout.tensor_parallel_size
    if learner_gpus < 1:
        raise ConfigError(f"--learner-gpus must be >= 1, got {learner_gpus}")
    if rollout_gpus < tp:
        raise ConfigError(f"--rollout-gpus {rollout_gpus}: fewer than one rollout engine of {tp} GPUs (rates file)")
    n, servers = cfg.rollout.n, rollout_gpus // tp
    # tether's own default for the groups a server takes at once (a config's explicit value wins), with this
    # fleet's server count and the rates file's engine batch.
    engine = cfg.rollout.engine.model_copy(update={"max_num_seqs": rates.rollout.max_num_seqs})
    sized = cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"num_servers": servers, "engine": engine})}
    )
    lr = rates.learner
    learner_tps = lr.tokens_per_s_per_gpu * learner_gpus * (lr.scaling_efficiency if learner_gpus > 1 else 1.0)
    wl = rates.workload
    return FleetSpec(
        train_batch_size=cfg.learner.train_batch_size,
        n=n,
        max_staleness=cfg.algorithm.max_staleness,
        stale_wait=cfg.algorithm.stale_wait_s > 0,
        sync_every=cfg.weight_sync.sync_every,
        servers=servers,
        slots_per_server=prompt_workers(sized),
        server_tokens_per_s=rates.rollout.tokens_per_s,
        seq_tokens_per_s=rates.rollout.seq_tokens_per_s,
        learner_step_s=lr.step_overhead_s,
        learner_tokens_per_s=learner_tps,
        sync_s=sync_cost(weight_path(rates), full_bytes=full_bytes(rates), servers=servers).seconds,
        lengths=Lengths(mean=wl.completion_mean, cv=wl.completion_cv, max_tokens=cfg.rollout.max_tokens),
        prompt_tokens=wl.prompt_tokens,
        inflight=cfg.weight_sync.inflight,
    )
