"""A policy from a run's `model` config: the digits world or a diffusers pipeline, LoRA or full fine-tuning."""

from __future__ import annotations

import torch

from flowrl.config import ModelConfig


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_policy(model: ModelConfig, *, forward_batch_size: int, device="cpu", log=print):
    """A `DiffusionPolicy` for `model`, on `device`, with its trainable parameters set.

    Args:
        model (`ModelConfig`): `name` is `digits` (the embedded offline world, built into the cache on first
            use) or a diffusers hub id / local folder (SD3.x, Flux.1, SD1.x/2.x).
        forward_batch_size (`int`): rows per network forward (`sampling.forward_batch_size`).
        device: where the model lives.
        log (`Callable`, *optional*): progress messages of a first digits build (None: silent).

    With `lora_rank > 0` a peft LoRA adapter trains in fp32 over the (possibly bf16) frozen base; otherwise
    every weight trains.
    """
    from flowrl.policies import DiffusionPolicy

    if model.name == "digits":
        from flowrl.digits import BuildConfig, load_world

        world = load_world(BuildConfig(pretrain_steps=model.digits_pretrain_steps), log=log)
        policy = world.policy(forward_batch_size=forward_batch_size)
        policy.model.to(device)
    else:
        policy = DiffusionPolicy.from_pretrained(model.name, family=model.family, dtype=DTYPES[model.dtype],
                                                 device=device, max_sequence_length=model.max_sequence_length,
                                                 forward_batch_size=forward_batch_size)  # fmt: skip
    if model.lora_rank > 0:
        policy.add_lora(rank=model.lora_rank, alpha=model.lora_alpha, target_modules=model.lora_targets)
        for param in policy.trainable_parameters():  # the adapter trains in fp32 over a bf16/fp16 base
            param.data = param.data.float()
    else:
        policy.model.requires_grad_(True)
    if model.gradient_checkpointing:
        policy.model.enable_gradient_checkpointing()
    return policy
