"""``rollout``: rollout servers — engine, sampling defaults, rewards, serving limits."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tether.config.base import Section

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (its ``MaxLoRARanks``, 0.32); any other fails the engine's start."""


class EngineSection(Section):
    """The base of every engine's config: its ``type`` (the tag in :data:`EngineConfig`), the batch it runs,
    and what the engine can do — declared here, where the engine is registered, and read by ``tether up``
    and the fleet instead of comparing engine names."""

    type: str
    shares_base: ClassVar[bool] = False
    """LoRA runs of one base can share one engine, each row generating with its own adapter (an engine with a
    ``max_lora_rank`` takes adapters up to it)."""
    max_num_seqs: int = Field(default=64, gt=0)
    """Most sequences generated together (verl/vLLM name); a server's prompt workers are capped by it."""

    def uses_gpu(self, gpus: int) -> bool:
        """Whether a server of this engine opens a GPU on a box with ``gpus`` of them (``tether up`` places it)."""
        return True


class TransformersEngineConfig(EngineSection):
    """Batched generation with Hugging Face transformers and a KV cache; runs anywhere."""

    type: Literal["transformers"] = "transformers"
    shares_base: ClassVar[bool] = True
    device: str = "auto"
    """``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""

    def uses_gpu(self, gpus: int) -> bool:
        return self.device.startswith("cuda") or (self.device == "auto" and gpus > 0)

    max_num_seqs: int = Field(default=64, gt=0)
    """Most sequences generated together in one batch (verl/vLLM name)."""
    batch_wait_ms: float = Field(default=5.0, ge=0)
    """How long a new request waits for others to share its batch."""


class VllmEngineConfig(EngineSection):
    """vLLM's AsyncLLM with continuous batching; weights are loaded in place on update."""

    type: Literal["vllm"] = "vllm"
    shares_base: ClassVar[bool] = True
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take for weights and KV cache."""
    max_num_seqs: int = Field(default=256, gt=0)
    """Most sequences in one engine step."""
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    """Token budget of one engine step (chunked prefill); empty: vLLM's default."""
    tensor_parallel_size: int = Field(default=1, gt=0)
    """GPUs one engine spans with tensor parallelism."""

    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across requests sharing a prefix (the G samples of a group do)."""
    cpu_kvcache_space_gb: float = Field(default=1.0, gt=0)
    """KV cache size on the CPU build of vLLM (``VLLM_CPU_KVCACHE_SPACE``)."""
    log_stats_interval_s: float = Field(default=10.0, gt=0)
    """How often the engine's statistics are logged."""
    max_loras: int = Field(default=8, gt=0)
    """Adapters in one batch where LoRA runs of one base share this engine on a fleet (vLLM ``max_loras``);
    an update holds two versions of a run's adapter for a while, so give two per run."""
    max_lora_rank: int = Field(default=64, gt=0)
    """Highest adapter rank such a shared engine accepts (vLLM ``max_lora_rank``: one of
    :data:`VLLM_LORA_RANKS`); a run above it gets its own."""

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_lora_rank(cls, rank: int) -> int:
        if rank not in VLLM_LORA_RANKS:
            above = [r for r in VLLM_LORA_RANKS if r > rank]
            hint = f"; the next one up is {above[0]}" if above else ""
            raise ValueError(f"vLLM takes max_lora_rank from {list(VLLM_LORA_RANKS)}, not {rank}{hint}")
        return rank


class SglangEngineConfig(EngineSection):
    """SGLang's engine; GPU only."""

    type: Literal["sglang"] = "sglang"
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Passed to SGLang as ``mem_fraction_static``."""
    max_num_seqs: int = Field(default=256, gt=0)
    """SGLang's ``max_running_requests``."""
    tensor_parallel_size: int = Field(default=1, gt=0)
    """SGLang's ``tp_size``."""


EngineConfig = Annotated[TransformersEngineConfig | VllmEngineConfig | SglangEngineConfig, Field(discriminator="type")]


class ExactMatchReward(Section):
    """1.0 when the completion (stripped) equals ``reward_context[answer_key]``, else 0.0."""

    type: Literal["exact_match"] = "exact_match"
    answer_key: str = "answer"
    """Key of the prompt's ``reward_context`` holding the reference answer."""


class MathReward(Section):
    """1.0 when the last ``\\boxed{…}`` (or the last number) equals the reference numerically."""

    type: Literal["math"] = "math"
    answer_key: str = "answer"
    """Key of the prompt's ``reward_context`` holding the reference answer."""
    format_bonus: float = Field(default=0.0, ge=0, le=1)
    """Reward for a well-formed ``\\boxed{}`` answer that is wrong."""


class DemoReward(Section):
    """The reward of the demo task (see ``examples/`` and ``configs/demo.yaml``)."""

    type: Literal["demo"] = "demo"


class RemoteReward(Section):
    """A user's ``tether.v1.Reward`` gRPC service."""

    type: Literal["remote"] = "remote"
    address: str
    """host:port of the reward service."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Deadline of one Score/ScoreBatch call."""
    max_retries: int = Field(default=3, ge=0)
    """Retries on UNAVAILABLE / DEADLINE_EXCEEDED before the group is dead-lettered."""
    token: str = ""
    """Bearer token sent to the service, if it requires one."""


class DataSourceReward(Section):
    """A scorer per row by its ``data_source`` (verl's reward routing): built-in rules or the remote service."""

    type: Literal["data_source"] = "data_source"
    scorers: dict[str, str] = Field(default_factory=dict)
    """``data_source`` -> scorer (``gsm8k``, ``math``, ``math_any``, ``exact_match``, ``demo`` or ``remote``),
    added to the built-in routes (``openai/gsm8k``, ``lighteval/MATH``, the demo tasks, …; see
    ``tether/scorers.py``). A data source of the dataset with no route fails the learner at start."""
    remote: RemoteReward | None = None
    """The reward service of the sources routed to ``remote``."""

    @model_validator(mode="after")
    def _known_scorers(self) -> DataSourceReward:
        from tether.scorers import REMOTE, SCORERS

        for source, name in self.scorers.items():
            if name not in SCORERS and name != REMOTE:
                raise ValueError(f"scorers[{source!r}]: unknown scorer {name!r}; known: "
                                 f"{', '.join([*SCORERS, REMOTE])}")  # fmt: skip
            if name == REMOTE and self.remote is None:
                raise ValueError(f"scorers[{source!r}] is 'remote' but rollout.reward.remote is not set "
                                 "(give remote: {address: host:port})")  # fmt: skip
        return self


RewardConfig = Annotated[
    ExactMatchReward | MathReward | DemoReward | RemoteReward | DataSourceReward, Field(discriminator="type")
]


class OpenAIConfig(Section):
    """``rollout.openai``: the OpenAI-compatible HTTP door of each rollout server (docs/AGENTS.md). Agents written
    against the OpenAI API call ``/v1/chat/completions`` and ``/v1/completions``; a request that names an
    episode (``X-Tether-Episode``) is trained on, token for token."""

    port: int | None = Field(default=None, ge=0, le=65535)
    """HTTP port; empty disables the door, 0 picks a free one (published in the server registry as
    ``openai_address``)."""
    served_model_name: str | None = None
    """The model id ``/v1/models`` lists (vLLM's ``--served-model-name``); empty: the run id, else the model
    folder's name. Requests may name any model: the server has one."""
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "none"] = "auto"
    """How the model's tool calls are read from its text (vLLM's ``--tool-call-parser``): ``hermes`` (Qwen2.5/3,
    Hermes: ``<tool_call>{json}</tool_call>``), ``llama3_json`` (Llama 3.1+: a JSON object, optionally after
    ``<|python_tag|>``); ``auto`` picks from the chat template; ``none`` returns every output as text."""
    pause_wait_s: float = Field(default=60.0, ge=0)
    """A request arriving while the engine is paused (a weight update) waits this long for it to resume, then
    gets 503 with ``Retry-After``."""


class RolloutConfig(Section):
    engine: EngineConfig = Field(default_factory=TransformersEngineConfig)
    """Generation backend: ``type: transformers | vllm | sglang``."""

    reward: RewardConfig = Field(default_factory=DemoReward)
    """How completions of the prompts stream are scored: ``type: exact_match | math | demo | remote | data_source``."""

    n: int = Field(default=8, gt=0)
    """Samples per prompt: the GRPO group size G (verl: ``rollout.n``)."""

    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature of training rollouts. Behaviour log-probs are of ``softmax(logits / T)`` and
    the learner divides its logits by the same T (verl's convention), recorded per trajectory. 0 is
    greedy: log-probs of the T = 1 distribution on both sides (every sample of a group is the same)."""

    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass of training rollouts: must stay 1.0 (see ``_full_distribution``);
    evaluation-only Generate requests may set their own."""

    top_k: int = Field(default=-1, ge=-1)
    """Top-k of training rollouts: must stay -1 or 0 (disabled); Generate requests may set their own."""

    max_tokens: int = Field(default=256, gt=0)
    """Most completion tokens per sample (per turn for episodes)."""

    stop: list[str] = Field(default_factory=list)
    """Strings that end a completion of the prompts stream (training and evaluation rollouts; vLLM's
    ``stop``): the token that completes one is the last sampled, and stays in the trained ids. E.g.
    ``["\\n"]`` for a few-shot prompt whose answer is one line. Generate requests and episodes set their own."""

    max_prompt_len: int = Field(default=1024, gt=0)
    """Longest prompt in tokens (at most the model's context - 1): longer requests are rejected with
    INVALID_ARGUMENT, longer prompts of the prompts stream dead-lettered. Not given: ``learner.max_prompt_length``
    when that is set (one limit, verl's ``data.max_prompt_length``), else 1024. The learner checks the
    dataset against the same limit at start."""

    max_n: int = Field(default=64, gt=0)
    """Largest ``n`` one Generate request may ask for."""

    num_servers: int = Field(default=1, ge=0)
    """Rollout server processes ``tether up`` starts on this machine."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds to."""

    port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (it is published in the server registry)."""

    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Prometheus metrics port; empty disables the endpoint, 0 picks a free one."""

    server_id: str | None = None
    """Name in the server registry; empty: hostname and port."""

    max_concurrent_requests: int = Field(default=256, gt=0)
    """Requests admitted at once; more get RESOURCE_EXHAUSTED."""

    max_message_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """gRPC send/receive message size limit, set on both ends."""

    auth_token: str = ""
    """Bearer token required on every call when set (always on Control). Prefer the
    ``TETHER_AUTH_TOKEN`` environment variable to writing it here."""

    tls_cert: str = ""
    """PEM certificate file; with ``tls_key`` the server speaks TLS."""

    tls_key: str = ""
    """PEM private key file."""

    episode_idle_timeout_s: float = Field(default=300.0, gt=0)
    """An episode with no call for this long ends: dropped, and one that holds a model turn is dead-lettered
    with the reason (``tether status`` shows it)."""

    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)
    """The OpenAI-compatible HTTP door (off until ``port`` is set)."""

    pause_timeout_s: float = Field(default=600.0, ge=0)
    """A server paused by the ``Pause`` RPC and not resumed within this long resumes by itself (logged as
    ``pause_expired`` and counted in ``tether_rollout_pauses_expired``): a client that died between the two
    calls does not leave it idle for good. A later ``Pause`` starts the clock again; 0 waits for ``Resume``."""

    heartbeat_s: float = Field(default=2.0, gt=0)
    """Interval of registry heartbeats; the entry expires after three missed beats."""

    prompt_workers: int | None = Field(default=None, ge=0)
    """Prompts a server works on at once from the prompts stream; 0: serve gRPC only; empty: what the step
    needs, ``learner.train_batch_size × (algorithm.max_staleness + 1)`` split over ``num_servers`` and at
    most ``engine.max_num_seqs // n`` (see ``tether/resources.py``)."""

    drain_timeout_s: float = Field(default=30.0, gt=0)
    """On SIGTERM, how long in-flight work may take before it is returned to the stream."""

    reward_attempts: int = Field(default=2, gt=0)
    """Times a group's scoring is attempted (each with the reward's own retries) before the group is
    dead-lettered and its prompt acknowledged."""

    @field_validator("top_p", "top_k")
    @classmethod
    def _full_distribution(cls, value: float, info) -> float:
        # The learner recomputes log-probs of softmax(logits / T) over the whole vocabulary; a truncated
        # sampling distribution would make every importance weight and PPO ratio of the wrong quantity.
        if (info.field_name == "top_p" and value != 1.0) or (info.field_name == "top_k" and value > 0):
            default = "1.0" if info.field_name == "top_p" else "-1"
            raise ValueError(
                "refused: training rollouts sample the full temperature-scaled distribution the "
                f"learner recomputes; keep {default} (top-p/top-k may be set per Generate request for evaluation)"
            )
        return value

    share: float = Field(default=1.0, gt=0)
    """This run's weight on a rollout fleet that serves several runs (``tether rollout --runs a,b``): under
    contention the fleet gives runs generated tokens in proportion to their shares; an idle run's share goes
    to the others. Unused by a server of one run."""

    exit_when_run_ends: bool = False
    """Exit (code 0, after a drain) once the learner has published that the run finished; off: stay up
    and idle (right for servers a Deployment would restart). ``tether rollout --exit-when-run-ends``."""

    @model_validator(mode="after")
    def _tls_pair(self) -> RolloutConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        return self
