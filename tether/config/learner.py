"""``learner``: the FSDP2 training loop — batch sizes, optimizer, memory and speed levers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tether.config.base import Section


class ProfileConfig(Section):
    steps: list[int] = Field(default_factory=list)
    """Learner steps to profile (torch profiler trace per rank in ``{run}/profile``)."""


class LearnerConfig(Section):
    nproc_per_node: int = Field(default=1, gt=0)
    """Learner processes per node (torchrun ``--nproc_per_node``)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: cuda (NCCL) when available, else cpu (gloo)."""

    total_steps: int = Field(default=100, gt=0)
    """Optimizer steps of the run."""

    train_batch_size: int = Field(default=8, gt=0)
    """Prompts (groups) one learner step consumes: B of the admission rule (verl:
    ``data.train_batch_size``)."""

    ppo_mini_batch_size: int | None = Field(default=None, gt=0)
    """Prompts per optimizer update inside a step; empty: the whole ``train_batch_size``."""

    ppo_epochs: int = Field(default=1, gt=0)
    """Passes over each step's data."""

    micro_batch_size_per_gpu: int = Field(default=4, gt=0)
    """Sequences per forward/backward on one GPU (without dynamic batching)."""

    use_remove_padding: bool = True
    """Pack sequences into one row with per-sequence position ids: no compute on padding."""

    share_prompts: bool = True
    """With packed rows on tether's varlen kernels: a prompt that several samples of a micro-batch share (a
    GRPO group's) runs through the model once, each completion attending to it — the same log-probs and
    gradients as one copy per sample, with the prompt's tokens computed once (a long few-shot prompt with
    short answers: most of the step). On tether's split kernel (CPU, and GPUs without the torch varlen kernel);
    flash_attention_2, the torch varlen kernel and Ulysses get a copy per sample."""

    use_dynamic_bsz: bool = True
    """Form micro-batches by token budget instead of a fixed count."""

    max_token_len_per_gpu: int = Field(default=8192, gt=0)
    """Token budget of one micro-batch on one GPU with ``use_dynamic_bsz``; without ``use_remove_padding`` it
    counts padded slots (rows x the longest row), and sequences of like length share a micro-batch."""

    ulysses_sequence_parallel_size: int = Field(default=1, gt=0)
    """Ulysses sequence parallelism: SP consecutive learner ranks share each packed row (a 1/SP slice of
    the tokens each, heads exchanged around attention), so the ranks form W/SP data-parallel groups and
    ``max_token_len_per_gpu`` x SP is a group's token budget. Needs ``use_remove_padding`` (verl name)."""

    log_prob_micro_batch_size_per_gpu: int | None = Field(default=None, gt=0)
    """Micro-batch of forward-only passes (log-prob recomputation, reference); empty: 2x training."""

    log_prob_max_token_len_per_gpu: int | None = Field(default=None, gt=0)
    """Token budget of forward-only passes; empty: 2x ``max_token_len_per_gpu``."""

    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate of AdamW."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""

    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps."""

    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to ``min_lr_ratio`` x lr at ``total_steps``."""

    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the cosine schedule as a fraction of ``lr``."""

    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip."""

    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """FSDP2 compute dtype of parameters (master weights and optimizer state stay float32). ``auto``:
    bfloat16 on GPU, float32 on CPU; ``bfloat16`` on CPU pays where the cores have native bf16 (AVX512-BF16,
    AMX) — TRL's ``bf16=True`` default does the same there with autocast."""

    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 gradient reduction dtype."""

    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    enable_activation_offload: bool = False
    """Keep the activations saved for backward in pinned CPU memory (with gradient checkpointing: the
    blocks' inputs) and bring them back in backward (verl's name). CUDA only; on CPU it is ignored with
    one log line."""

    forward_prefetch: bool = False
    """Prefetch the next block's all-gather during forward (FSDP2)."""

    cpu_offload: bool = False
    """Keep sharded parameters and optimizer state in CPU memory."""

    use_liger: bool = False
    """Use Liger kernels (GPU, package liger-kernel)."""

    varlen_attention: Literal["split", "torch"] = "split"
    """The attention kernel of packed rows (``use_remove_padding`` with ``model.attn_implementation`` sdpa
    or eager): ``split`` runs sdpa per sequence (or per run of equal lengths), anywhere; ``torch`` runs torch's
    flash varlen kernel (``torch.nn.attention.varlen``, torch ≥ 2.10, CUDA, bf16/fp16 compute), one launch
    per layer for the whole micro-batch. On an H200 with ~4K-token sequences ``torch`` ran 0.92× of ``split``
    without activation checkpointing and 1.04× with it (bench/learner_mfu.py): long sequences keep each sdpa
    call large, so the split kernel is the default; ``torch`` is for many short sequences."""

    use_torch_compile: bool = False
    """Compile each decoder block with ``torch.compile`` (torchtitan's per-block compile; the attention call
    stays outside the graph). The first steps pay the compile (~25 s on an H200 at the Qwen2.5-0.5B shape);
    sequence lengths become dynamic after one recompile. Measured there: 1.12× without activation
    checkpointing, 0.82× with it."""

    use_fused_kernels: bool = False
    """The LM head fused with log-probs and entropy, chunk by chunk (``learner.fused_head``; verl's name for the
    same idea): no ``[tokens, vocab]`` logits are kept for backward or copied to float32 whole; each chunk's
    are recomputed in backward. Packed rows (``use_remove_padding``) without sequence parallelism; other
    layouts keep the plain head."""

    shard_single_rank: bool = False
    """Wrap the model in FSDP2 on one rank too (bf16 copies of the weights made once per block per pass by
    FSDP2's mixed precision), instead of a plain module under autocast (weights re-cast at every matmul).
    Measured on an H200 at the Qwen2.5-0.5B shape: 0.79× of the plain module, so it is off by default."""

    entropy_from_logits_with_chunking: bool = True
    """Compute entropy over the vocabulary in chunks so the [tokens, vocab] peak stays bounded."""

    entropy_checkpointing: bool = False
    """Recompute the entropy in backward instead of keeping its activations."""

    checkpoint_every: int = Field(default=50, ge=0)
    """Steps between checkpoints (0: only at the end)."""

    export_hf: bool = True
    """Write the final weights in Hugging Face format to ``{run}/final``."""

    data_path: str = ""
    """Prompts: a ``.parquet`` file (read in batches, verl's layout as is), a ``.jsonl``, ``.json`` or
    ``.csv`` file, a folder a ``datasets`` ``save_to_disk`` wrote or of data files ``load_dataset`` reads,
    or ``demo:<task>`` for a built-in task (see docs/DATA.md). Empty: the learner feeds no prompts and
    trains only on episodes that custom environments drive."""

    prompt_key: str = "prompt"
    """Column holding the prompt: a string (sent as it is) or a list of chat messages (rendered with the
    tokenizer's chat template and the generation prompt) (verl: ``data.prompt_key``)."""

    answer_key: str = ""
    """Column of the reference answer (``a.b`` reads a field of a struct column), put in the reward context
    as ``answer``; empty: ``answer``, else verl's ``reward_model.ground_truth``."""

    data_source_key: str = "data_source"
    """Column naming the row's data source: rewards are routed by it (``rollout.reward.type: data_source``)
    and evaluation metrics are split by it."""

    max_prompt_length: int | None = Field(default=None, gt=0)
    """Longest prompt in tokens after the chat template (verl: ``data.max_prompt_length``); empty:
    ``rollout.max_prompt_len``. It is one limit with the rollout servers': given here while
    ``rollout.max_prompt_len`` is not, the servers take it too; given both, this one may be lower but not
    higher. The learner checks every prompt of ``data_path`` and ``val_data_path`` against it once at start
    (capped, as the servers cap it, at the model's context: ``model.max_model_len`` - 1)."""

    truncation: Literal["error", "left", "right"] = "error"
    """A prompt over the limit (``max_prompt_length``): ``error`` fails at start naming the row and the
    setting; ``left``/``right`` keep its last/first tokens (verl: ``data.truncation``); ``left`` keeps the
    tokenizer's leading BOS and cuts the oldest text after it."""

    filter_overlong_prompts: bool = False
    """Drop prompts over ``max_prompt_length`` instead (counted and shown at start) (verl name)."""

    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve Prometheus metrics from learner rank 0 on this port (0: a free one); empty: off."""

    log_train_generations: int = Field(default=2, ge=0)
    """Groups of each logged step rank 0 keeps in ``{run}/generations.jsonl`` for ``tether view`` (prompt,
    completions, per-token versions and log-probs, reward, advantage, staleness, server), spread over the
    step's batch, plus the newest dead letters in ``{run}/dead_letters.jsonl`` (verl's
    ``trainer.log_val_generations``, for the groups trained on); 0: neither."""

    log_generations_every: int = Field(default=1, gt=0)
    """Log the groups of every this many steps; the interval doubles each time the file is thinned to
    stay within ``generations_max_mb``."""

    generations_max_mb: float = Field(default=32.0, gt=0)
    """Most MiB ``generations.jsonl`` holds: before a step's lines would take it over, the lines of every
    other logged step go and the interval doubles, so the sample spans the whole run. ``dead_letters.jsonl``
    holds a quarter of it (the newest)."""

    read_timeout_s: float = Field(default=0.0, ge=0)
    """Give up (exit with an error) when no trajectory group arrives for this long; 0: wait forever."""

    stuck_timeout_s: float = Field(default=60.0, ge=0)
    """End a run that cannot train: when, while the learner waits for a step's groups, none it can train
    has come for this long and at least a step's worth (``train_batch_size``) were dead-lettered or dropped
    as stale meanwhile (and still are), the learner exits non-zero with the most common reason and the
    setting to check — prompts the servers refuse, a reward service that is not there, weights that never
    reach the servers. The clock starts at the first such group, so loading models, servers registering
    and slow steps never count; a minute leaves room for a long generation's in-flight groups that go
    stale after a weight update. 0: never; the run keeps warning and waiting."""

    val_data_path: str = ""
    """Held-out prompts for evaluation during training: a file or folder as for ``data_path`` (same columns)
    or ``demo:<task>`` (that task's held-out split). Empty: no evaluation."""

    test_freq: int = Field(default=0, ge=0)
    """Evaluate every this many learner steps, and after the last step (verl name); 0: never."""

    val_before_train: bool = False
    """Also evaluate the starting weights, before the first step (verl name)."""

    val_n: int = Field(default=1, gt=0)
    """Samples per evaluation prompt: k of ``val/mean@k`` and ``val/pass@k``."""

    val_temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of evaluation; 0 is greedy (verl's default)."""

    val_max_tokens: int | None = Field(default=None, gt=0)
    """Most completion tokens per evaluation sample; empty: ``rollout.max_tokens``."""

    val_max_prompts: int | None = Field(default=None, gt=0)
    """Prompts per evaluation round: the first N rows of the dataset (empty: all of them), or N held-out
    rows of a demo task (empty: 128)."""

    val_timeout_s: float = Field(default=300.0, gt=0)
    """An evaluation round still incomplete after this long is closed; prompts without results are
    counted in ``val/missing`` (the learner never waits longer than this for evaluation)."""

    @model_validator(mode="after")
    def _evaluation(self) -> LearnerConfig:
        if (self.test_freq or self.val_before_train) and not self.val_data_path:
            raise ValueError("val_data_path is empty but test_freq/val_before_train ask for evaluation — set "
                             "learner.val_data_path (a dataset file or folder, or demo:TASK)")  # fmt: skip
        if self.val_data_path.startswith("demo:"):
            from tether.tasks import DEMO_TASKS

            task = self.val_data_path.split(":", 1)[1]
            if task not in DEMO_TASKS:
                raise ValueError(f"val_data_path: unknown demo task {task!r}; known: {', '.join(DEMO_TASKS)}")
        if self.val_n > 1 and self.val_temperature == 0:
            raise ValueError(f"val_n is {self.val_n} but val_temperature is 0: greedy samples are all the same — "
                             "set learner.val_temperature > 0 or learner.val_n: 1")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _sequence_parallel(self) -> LearnerConfig:
        if self.ulysses_sequence_parallel_size > 1 and not self.use_remove_padding:
            raise ValueError(f"ulysses_sequence_parallel_size is {self.ulysses_sequence_parallel_size} but "
                             "use_remove_padding is false — sequence parallelism splits packed rows; set "
                             "learner.use_remove_padding: true")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _mini_batch_divides(self) -> LearnerConfig:
        mini = self.ppo_mini_batch_size
        if mini is not None and (mini > self.train_batch_size or self.train_batch_size % mini):
            raise ValueError(f"ppo_mini_batch_size ({mini}) must divide train_batch_size ({self.train_batch_size})")
        return self
