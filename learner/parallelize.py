"""Load the policy and apply the memory/speed levers, then FSDP2: ``fully_shard`` per block, then the root.

The order follows torchtitan: kernels (Liger) and activation checkpointing change the module first, then
sharding wraps it. One :class:`MixedPrecisionPolicy` is built once and shared by every ``fully_shard``
call so the blocks and the root agree on dtypes: parameters compute in ``learner.param_dtype`` with
``learner.reduce_dtype`` gradient reduction (float32 by default). ``auto`` is bf16 on GPU and float32 on
CPU (the test path); ``bfloat16`` set explicitly applies on CPU too, where it pays on cores with native
bf16 (AVX512-BF16, AMX): 1.6× faster forward and backward at 256 wide on one such core. The sharded
master weights, the gradients and the optimizer state are always float32.
"""

from __future__ import annotations

import itertools
import sys

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from learner import fused_head, lora, meta_init, ulysses, varlen_attention
from learner.attention_check import attention_path, check_flash, check_varlen_kernel
from tether.config import TetherConfig
from tether.logs import get_logger

log = get_logger(__name__)
_MISSING = object()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compute_dtype(cfg: TetherConfig, device: torch.device) -> torch.dtype:
    """``learner.param_dtype`` resolved for ``device``: ``auto`` is bf16 on CUDA, float32 elsewhere."""
    name = cfg.learner.param_dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return _DTYPES[name]


def mixed_precision_policy(cfg: TetherConfig, device: torch.device) -> MixedPrecisionPolicy:
    param_dtype = compute_dtype(cfg, device)
    if device.type != "cuda" and param_dtype == torch.float32:  # CPU in float32: gloo reduces in float32
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    _warn_if_emulated(param_dtype, device)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_DTYPES[cfg.learner.reduce_dtype])


def _warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    if dtype == torch.bfloat16 and device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        log.warning("learner_bf16_emulated", hint="this CPU has no native bf16: param_dtype float32 is faster")


def attn_implementation(cfg: TetherConfig, device: torch.device) -> str:
    """The kernel the learner runs, with a clear error where the configured one cannot run.

    Packed rows (``use_remove_padding``) with sdpa/eager get :mod:`learner.varlen_attention` instead:
    transformers would otherwise attend over the whole row through a ``(ΣL)²`` block-diagonal mask,
    which makes packing slower than padding. flash_attention_2 has its own varlen kernel and stays.
    With ``ulysses_sequence_parallel_size > 1`` either kernel runs inside :mod:`learner.ulysses`'s all-to-alls.
    The checks are :mod:`learner.attention_check`'s, which ``tether up`` also makes before it starts anything.
    """
    impl = cfg.model.attn_implementation
    path = attention_path(cfg)
    if path == "ulysses":
        check_flash(impl, cuda=device.type == "cuda")
        return ulysses.register("flash_attention_2" if impl == "flash_attention_2" else varlen_attention.register())
    if path == "varlen":
        return varlen_attention.register(varlen_kernel(cfg, device))
    check_flash(impl, cuda=device.type == "cuda")
    return impl


def varlen_kernel(cfg: TetherConfig, device: torch.device) -> str:
    """``learner.varlen_attention``, refused where it cannot run: ``torch`` needs CUDA, torch ≥ 2.10 and
    half-precision compute."""
    runs = varlen_attention.torch_varlen_available(device) and compute_dtype(cfg, device) != torch.float32
    return check_varlen_kernel(cfg, runs=runs, device=str(device), torch_version=torch.__version__)


def load_model(cfg: TetherConfig, device: torch.device, *, meta: bool = False) -> torch.nn.Module:
    """The HF causal LM from ``model.path`` in float32 on CPU (sharding moves it to ``device``).

    ``meta``: its parameters on the meta device instead, as the learner builds its models: :func:`parallelize`
    then loads into each rank's shard only that rank's slices of the checkpoint (:mod:`learner.meta_init`), so
    no rank ever holds the whole model."""
    from transformers import AutoModelForCausalLM

    if not cfg.model.path:
        raise ValueError("model.path is empty: point it at a local Hugging Face model folder")
    kwargs = {
        "dtype": torch.float32,
        "attn_implementation": attn_implementation(cfg, device),
        "trust_remote_code": cfg.model.trust_remote_code,
    }
    if meta:
        model = meta_init.build(cfg.model.path, auto_class=AutoModelForCausalLM, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, **kwargs)
    model.config.use_cache = False
    return model


def load_actor(cfg: TetherConfig, device: torch.device, *, meta: bool = False) -> torch.nn.Module:
    """The policy: :func:`load_model`, wrapped with fresh LoRA adapters when ``model.lora`` is set."""
    model = load_model(cfg, device, meta=meta)
    return lora.apply_lora(model, cfg.model.lora) if cfg.model.lora is not None else model


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, found by the class names HF lists as never-split (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise RuntimeError(f"{type(model).__name__}: cannot find decoder blocks to shard (_no_split_modules={names})")
    return blocks


def apply_liger(model: torch.nn.Module, device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError("learner.use_liger needs a GPU (Liger kernels are Triton); set it to false on CPU")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise RuntimeError("learner.use_liger: the liger-kernel package is missing (pip install -e .[gpu])") from None
    # Liger patches the model family's modeling module too (its RMSNorm and MLP classes, its rotary function),
    # so every model of that family built later in this process would get Triton kernels — a CPU one as well,
    # where they cannot run (a reference or reward model on CPU; seen on an H200: the next CPU forward failed).
    # Only this instance is meant: the modules are put back, which leaves out Liger's rotary kernel (a
    # module-level function with no per-instance hook); the RMSNorm and SwiGLU modules stay patched.
    saved = {name: dict(vars(mod)) for name, mod in list(sys.modules.items()) if name.startswith("transformers.")}
    try:
        # Only the element-wise kernels: the fused linear cross-entropy would hide the logits we need.
        _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    finally:
        _restore_modules(saved)


def _restore_modules(saved: dict[str, dict]) -> None:
    """Put back every global of these modules that was rebound (the modules' dicts as they were)."""
    for name, before in saved.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        now = vars(module)
        for key, value in before.items():
            if now.get(key, _MISSING) is not value:
                setattr(module, key, value)


def parallelize(
    model: torch.nn.Module,
    cfg: TetherConfig,
    device: torch.device,
    *,
    mesh: DeviceMesh | None = None,
    trainable: bool = True,
    shard: bool | None = None,
) -> torch.nn.Module:
    """Apply Liger, activation checkpointing and FSDP2 to ``model`` in place; returns it. A model built on the
    meta device (``load_model(..., meta=True)``) gets its weights last, each rank its own shard.

    ``shard``: wrap with FSDP2 (an FSDPModule). By default only where it does something — a mesh of
    several ranks, or parameters offloaded to CPU. On one rank with nothing offloaded FSDP2 has nothing to
    shard, gather or reduce, yet its hooks run around every block (torchtitan skips it there too): the
    model stays a plain module, and a bf16 ``learner.param_dtype`` computes under autocast (float32 master
    weights and gradients, as with FSDP2's mixed precision). At the demo size that cut the learner step by
    about a tenth.
    """
    lc = cfg.learner
    _apply_levers(model, cfg, device, trainable=trainable)
    offload = lc.cpu_offload and device.type == "cuda"
    on_meta = meta_init.pending(model) is not None
    ranks = mesh.size() if mesh is not None else torch.distributed.get_world_size()
    if not (shard if shard is not None else ranks > 1 or offload or lc.shard_single_rank):
        return _unsharded(model, cfg, device, trainable=trainable)
    if mesh is None:
        mesh = init_device_mesh(device.type, (ranks,))
    kwargs: dict = {"mesh": mesh, "mp_policy": mixed_precision_policy(cfg, device)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif device.type == "cuda" and not on_meta:  # on meta, fully_shard moves the real tensors (buffers)
        model.to(device)
    blocks = decoder_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root is used again right after forward (backward starts with the LM head): keep it gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if lc.forward_prefetch:
        for this, nxt in itertools.pairwise(blocks):
            this.set_modules_to_forward_prefetch([nxt])
    if on_meta:  # sharded now: each rank reads its own slices (CPU-offloaded shards live on the CPU)
        meta_init.materialize(model, torch.device("cpu") if offload else device)
    _freeze_unless(trainable, model)
    log.info(
        "model_sharded",
        device=str(device),
        blocks=len(blocks),
        world=mesh.size(),
        params=sum(p.numel() for p in model.parameters()),
        attn=model.config._attn_implementation,
    )
    return model


def _apply_levers(model: torch.nn.Module, cfg: TetherConfig, device: torch.device, *, trainable: bool) -> None:
    """What changes the module before sharding wraps it, in torchtitan's order: kernels (Liger), activation
    checkpointing (a trainable model only), the fused LM head, then per-block compile."""
    lc = cfg.learner
    if lc.use_liger:
        apply_liger(model, device)
    if trainable and lc.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # HF checkpoints a block only while the block is in training mode, and from_pretrained returns the
        # model in eval mode: without this the setting did nothing. Only the blocks themselves are flagged,
        # so dropout inside them (0 in the usual LMs, and it would make log-probs random) stays off.
        for block in decoder_blocks(model):
            block.training = True
    if lc.use_fused_kernels:
        fused_head.install(model)
    if trainable:
        sparse_tied_embedding_grad(model, token_budget=lc.max_token_len_per_gpu)
    if lc.use_torch_compile:
        compile_blocks(model)


def sparse_tied_embedding_grad(model: torch.nn.Module, *, token_budget: int) -> bool:
    """Where the LM head shares the input embedding's weight, the embedding's gradient is made sparse (its
    ``sparse`` flag); whether it was.

    The tied weight then gets two gradients, the head's (dense, ``[V, H]``) and the lookup's. As a dense
    tensor the lookup's is a second ``[V, H]`` (zeros but the rows of the micro-batch's tokens) alive beside
    the first until autograd sums them: 671 MB more at Gemma 3's 262k x 640 embedding in float32, the
    learner's peak RSS on the real Gemma job 6.56 -> 5.89 GB (measured, one rank). Sparse, it is the used rows
    only (``[tokens, H]``) and autograd adds it into the head's gradient in place: the parameter's ``.grad``
    stays dense, so AdamW, clipping and FSDP2's reduce-scatter see what they saw. Only where a micro-batch's
    tokens (``learner.max_token_len_per_gpu``) are fewer than the vocabulary, where sparse is the smaller."""
    inputs, outputs = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb, head = (inputs() if inputs else None), (outputs() if outputs else None)
    if not isinstance(emb, torch.nn.Embedding):
        return False
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    if not tied or not emb.weight.requires_grad or emb.num_embeddings <= token_budget:
        return False
    emb.sparse = True
    return True


def compile_blocks(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder block in place (torchtitan's per-block compile: one graph per block
    kind, reused by every layer). The varlen attention functions stay outside the graph (they are marked
    ``torch.compiler.disable``): they split by host lengths, which would be guarded on and recompile per
    micro-batch."""
    for block in decoder_blocks(model):
        block.compile()


def _freeze_unless(trainable: bool, model: torch.nn.Module) -> None:
    if not trainable:
        model.requires_grad_(False)
        model.eval()


def _unsharded(model: torch.nn.Module, cfg: TetherConfig, device: torch.device, *, trainable: bool) -> torch.nn.Module:
    """One rank, nothing offloaded: the plain module on ``device``, bf16 compute through autocast."""
    if meta_init.pending(model) is not None:
        meta_init.materialize(model, device)
    model.to(device)
    dtype = compute_dtype(cfg, device)
    if dtype != torch.float32:
        _warn_if_emulated(dtype, device)
        model.forward = torch.autocast(device.type, dtype=dtype)(model.forward)
    _freeze_unless(trainable, model)
    log.info(
        "model_unsharded",
        reason="one rank, nothing offloaded",
        device=str(device),
        compute_dtype=str(dtype).removeprefix("torch."),
        params=sum(p.numel() for p in model.parameters()),
        attn=model.config._attn_implementation,
    )
    return model
