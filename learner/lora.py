"""LoRA on the actor: peft adapters under FSDP2, adapter-only weight updates, adapter + merged export.

``model.lora`` wraps the loaded HF model with peft's ``get_peft_model`` before sharding; peft freezes
the base weights, so the optimizer (which takes ``requires_grad`` parameters) holds the adapters only and
FSDP2 shards both kinds in the same blocks. Weight updates send the adapter tensors alone, named as peft
saves them (``base_model.model.<module>.lora_A.weight``; see :func:`adapter_params`), and the rollout
servers add ``alpha / rank * B @ A`` to their own copy of the base weights (:mod:`weight_sync.lora`).
``model.lora.modules_to_save`` (peft's knob) trains whole modules beside the adapters: peft keeps a
trainable copy of each, which travels whole under its saved name (``base_model.model.model.norm.weight``)
and replaces the receiver's weight. Checkpoints hold the adapters, the saved modules and their optimizer
state (the base weights are ``model.path``'s); ``final/`` holds the merged Hugging Face model and
``final/adapter/`` the peft adapter (with the saved modules, as peft writes them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tether.config.model import LoraConfig
from tether.logs import get_logger

log = get_logger(__name__)

ADAPTER_DIR = "adapter"
"""Sub-folder of ``final/`` with the peft adapter (``PeftModel.from_pretrained(base, final/adapter)``)."""


def peft_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
        modules_to_save=lora.modules_to_save or None,
        ensure_weight_tying=bool(lora.modules_to_save),  # a saved tied embedding stays tied to its output layer
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` with fresh adapters (B = 0, so the output is the base model's at first)."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise RuntimeError("model.lora needs the peft package: pip install -e .[lora]") from None
    _check_tied(model, lora)
    config = peft_config(lora)
    wrapped = get_peft_model(model, config)
    _real_adapters(wrapped, config.init_lora_weights)
    if lora.dropout:
        # from_pretrained leaves the model in eval mode, where peft's dropout does nothing.
        for name, module in wrapped.named_modules():
            if name.endswith("lora_dropout.default"):
                module.train()
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    log.info("lora_applied", rank=lora.rank, alpha=lora.alpha, trainable=trainable,
             total=sum(p.numel() for p in wrapped.parameters()))  # fmt: skip
    return wrapped


def _real_adapters(model: torch.nn.Module, init: bool | str) -> None:
    """On a base built on the meta device (:mod:`learner.meta_init`) peft puts the fresh adapters beside their
    base layer, on meta too; they are not in the checkpoint, so they get real storage here and peft's own
    init again, before sharding: every rank starts from the same adapters (B = 0), as from a loaded base."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        meta = False
        for attr in module.adapter_layer_names:
            for name, part in getattr(module, attr).items():
                if isinstance(part, torch.nn.Module) and any(p.is_meta for p in part.parameters()):
                    part.to_empty(device="cpu")
                    meta = True
                elif isinstance(part, torch.nn.Parameter) and part.is_meta:
                    getattr(module, attr)[name] = torch.nn.Parameter(torch.empty_like(part, device="cpu"))
                    meta = True
        if meta:
            for adapter in module.lora_A.keys() | module.lora_embedding_A.keys():
                module.reset_lora_parameters(adapter, init)


def _check_tied(model: torch.nn.Module, lora: LoraConfig) -> None:
    """``modules_to_save`` entries each match a module (peft would skip one silently), and no LoRA target
    shares its weight with another module: a rollout server merges ``B @ A`` into the shared tensor, which
    would change its tied twin too (``embed_tokens`` of a tied ``lm_head``). A saved module may be tied:
    peft's ``ensure_weight_tying`` then trains one copy for both, and a server's tied pair stays equal."""
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = [n for n in lora.modules_to_save if not any(m.endswith(n) for m in modules)]
    if missing:
        raise ValueError(f"model.lora.modules_to_save: {missing} match no module of {model.config.name_or_path!r}")
    if lora.target_modules == "all-linear":  # peft leaves the output layer out of all-linear
        return
    owners: dict[int, list[str]] = {}
    for name, module in modules.items():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    for name, module in modules.items():
        if any(name.endswith(t) for t in lora.target_modules):
            for p in module.parameters(recurse=False):
                twins = [o for o in owners[id(p)] if o != name]
                if twins:
                    raise ValueError(
                        f"model.lora.target_modules: {name!r} shares its weight with {twins} (tied embeddings),"
                        " so a merged adapter would change both — put it in modules_to_save instead"
                    )


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def peft_name(name: str) -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` and
    ``...norm.modules_to_save.default.weight`` -> ``...norm.weight`` (the names peft saves)."""
    return name.replace(".modules_to_save.default.", ".").replace(".default.", ".")


def adapter_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters (adapters, saved modules) under the names peft saves them with: what a
    weight update sends."""
    return [(peft_name(n), p) for n, p in model.named_parameters() if p.requires_grad]


def export(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, out_dir: Path) -> torch.nn.Module:
    """Rank 0: write the adapter to ``out_dir/adapter``; returns a plain HF model with it merged in."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    copy = get_peft_model(AutoModelForCausalLM.from_config(model.config), model.peft_config["default"])
    copy.load_state_dict(state_dict)
    copy.save_pretrained(Path(out_dir) / ADAPTER_DIR, safe_serialization=True)
    return copy.merge_and_unload()
