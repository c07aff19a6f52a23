"""A policy from a run's `model` section: a diffusers pipeline (hub id or folder), with LoRA or full fine-tuning."""

from __future__ import annotations

import torch

from flowrl.models.config import ModelConfig


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_policy(model: ModelConfig, *, forward_batch_size: int | None, device="cpu"):
    """A `DiffusionPolicy` over the pipeline `model.name` (a hub id or a `save_pretrained` folder of a registered
    family), with the family's `model.options`, on `device`; nothing set up for training yet (`prepare_training`).

    Args:
        model (`ModelConfig`): name, family, dtype and options.
        forward_batch_size (`int`): rows per network forward (`batch.micro_batch_size`).
        device: where the model lives.
    """
    from flowrl.models.attention import configure_attention
    from flowrl.policies import DiffusionPolicy

    policy = DiffusionPolicy.from_pretrained(model.name, family=model.family, dtype=DTYPES[model.dtype], device=device,
                                             options=model.options, forward_batch_size=forward_batch_size)  # fmt: skip
    configure_attention(policy.model, model.attention_backend, family=policy.family)  # `auto`: self-tested on CUDA
    if model.cache_text:
        policy.store_text(text_store_folder(model, policy))
    return policy


def text_store_folder(model: ModelConfig, policy):
    """`$FLOWRL_CACHE/text/<key>`: the key hashes the model's name, family, options and dtype and the first weights of
    each text encoder (a folder whose weights were replaced gets a new key, never another model's conditioning)."""
    import hashlib
    import json

    from flowrl.cache import cache_root
    from flowrl.policies.text_store import text_encoders

    fingerprint = {"name": model.name, "family": policy.family, "options": model.options, "dtype": model.dtype}
    for name, module in sorted(text_encoders(policy.adapter.pipeline).items()):
        first = next(iter(module.parameters()), None)
        fingerprint[name] = None if first is None else float(first.detach().float().flatten()[:4096].sum())
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "text" / f"{policy.family}-{key}"


def prepare_training(policy, model: ModelConfig, seed: int = 0):
    """Set what trains: with `lora_rank > 0` a peft LoRA adapter in fp32 over the (possibly bf16) frozen base,
    initialised from `seed` (the same on every process), otherwise every weight; gradient checkpointing when asked.
    Returns the policy."""
    if model.lora_rank > 0:
        policy.add_lora(rank=model.lora_rank, alpha=model.lora_alpha, target_modules=model.lora_targets, seed=seed)
        for param in policy.trainable_parameters():  # the adapter trains in fp32 over a bf16/fp16 base
            param.data = param.data.float()
    else:
        policy.model.requires_grad_(True)
    if model.gradient_checkpointing:
        policy.model.enable_gradient_checkpointing()
    return policy
