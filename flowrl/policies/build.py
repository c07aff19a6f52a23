"""A policy from a run's `model` section: a diffusers pipeline (hub id or folder), with LoRA or full fine-tuning."""

from __future__ import annotations

import torch

from flowrl.models.config import ModelConfig
from flowrl.policies.diffusion import DiffusionPolicy
from flowrl.policies.text_store import text_encoders


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_policy(model: ModelConfig, *, forward_batch_size: int | None, device="cpu", weights: bool = True):
    """A `DiffusionPolicy` over the pipeline `model.name` (a hub id or a `save_pretrained` folder of a registered
    family), with the family's `model.options`, on `device`; nothing set up for training yet (`prepare_training`).

    Args:
        model (`ModelConfig`): name, family, dtype and options.
        forward_batch_size (`int`): rows per network forward (`batch.micro_batch_size`).
        device: where the model lives.
        weights (`bool`): False builds the real-size networks without weights on the `meta` device, from the
            checkpoint's published architecture (`flowrl.models.published`) or a folder's own configs: what
            `flowrl plan` traces (`device` is then ignored and no text store is opened).
    """
    from flowrl.models.attention import configure_attention

    if not weights:
        from flowrl.models.published import build_pipeline

        pipe = build_pipeline(model.name, family=model.family, dtype=DTYPES[model.dtype], device="meta")
        pipe.to("meta")  # a tiny pipeline (`tiny:<family>`) comes with its small weights: none are read from here on
        return DiffusionPolicy.from_pipeline(pipe, options=model.options, forward_batch_size=forward_batch_size)
    policy = DiffusionPolicy.from_pretrained(
        model.name,
        family=model.family,
        dtype=DTYPES[model.dtype],
        device=device,
        options=model.options,
        forward_batch_size=forward_batch_size,
    )
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

    fingerprint = {"name": model.name, "family": policy.family, "options": model.options, "dtype": model.dtype}
    for name, module in sorted(text_encoders(policy.adapter.pipeline).items()):
        first = next(iter(module.parameters()), None)
        fingerprint[name] = None if first is None else float(first.detach().float().flatten()[:4096].sum())
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "text" / f"{policy.family}-{key}"


def prepare_training(policy, model: ModelConfig, seed: int = 0, mixed_precision: str = "no"):
    """Set what trains: with `lora_rank > 0` a peft LoRA adapter in `model.lora_dtype` over the (possibly bf16)
    frozen base, initialised from `seed` (the same on every process), otherwise every weight; gradient checkpointing
    (every block or a share of them) and regional compilation when asked. Returns the policy.

    Under mixed precision (`run.mixed_precision` bf16 / fp16) the adapted layers' inputs are not cast to the
    adapter's dtype: autocast computes the adapter in the low precision from the same bits either way, so the
    outputs are identical, without peft's fp32 copy of every adapted input and its bf16 copy kept for the backward.
    """
    if model.lora_rank > 0:
        policy.add_lora(rank=model.lora_rank, alpha=model.lora_alpha, target_modules=model.lora_targets, seed=seed)
        dtype = DTYPES[model.lora_dtype]
        for param in policy.trainable_parameters():  # the adapter trains in its own dtype over a bf16/fp16 base
            param.data = param.data.to(dtype)
        if mixed_precision != "no":
            for module in policy.model.modules():
                if hasattr(module, "cast_input_dtype_enabled"):
                    module.cast_input_dtype_enabled = False
    else:
        policy.model.requires_grad_(True)
    if model.gradient_checkpointing:
        enable_checkpointing(policy.model, model.gradient_checkpointing)
    if model.compile:
        for _, network in networks(policy.model):
            compile_blocks(network)
    return policy


def networks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """`(name, network)` of each diffusers network a trained module is made of (Wan 2.2's two experts, or itself)."""
    parts = getattr(model, "experts", None)
    return parts() if callable(parts) else [("", model)]


def repeated_blocks(network: torch.nn.Module) -> list[torch.nn.Module]:
    """The entries of every `ModuleList` of `network` whose name ends in `blocks` (`transformer_blocks`,
    `single_transformer_blocks`, `down_blocks`, ...), outermost lists only, in order."""
    blocks, lists = [], []
    for name, child in network.named_modules():
        if isinstance(child, torch.nn.ModuleList) and name.split(".")[-1].endswith("blocks"):
            if not any(name.startswith(f"{outer}.") for outer in lists):
                lists.append(name)
                blocks.extend(child)
    return blocks


def compile_blocks(network: torch.nn.Module) -> None:
    """Regional compilation: each repeated block compiled once for all its copies (diffusers'
    `compile_repeated_blocks` where the class names its blocks; else every entry of its `*blocks` lists)."""
    if getattr(network, "_repeated_blocks", None):
        network.compile_repeated_blocks()
        return
    for block in repeated_blocks(network):
        block.compile()


def enable_checkpointing(model: torch.nn.Module, share: bool | float = True) -> None:
    """Gradient checkpointing of the network's blocks (diffusers' `enable_gradient_checkpointing`): every block, or
    (`share` in (0, 1)) `round(share * n)` of its `n` blocks, evenly spread; the others keep their activations.
    Recomputed blocks give the same gradients (non-reentrant `torch.utils.checkpoint`)."""
    import torch.utils.checkpoint

    for _, network in networks(model):
        if share is True or share >= 1:
            network.enable_gradient_checkpointing()
            continue
        blocks = repeated_blocks(network)
        count = max(1, round(share * len(blocks)))
        chosen = {id(blocks[i * len(blocks) // count]) for i in range(count)}

        def selective(block, *args, chosen=chosen):
            if id(block) in chosen:
                return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
            return block(*args)

        network.enable_gradient_checkpointing(gradient_checkpointing_func=selective)


def offloads_text(model: ModelConfig, policy, device) -> bool:
    """Whether the run keeps the text encoders in CPU memory (`model.offload_text_encoders`; `auto`: a network of
    8B parameters or more on a GPU)."""
    setting = model.offload_text_encoders
    if setting != "auto":
        return bool(setting)
    if torch.device(device).type == "cpu":
        return False
    return sum(p.numel() for p in policy.model.parameters()) >= OFFLOAD_FROM


OFFLOAD_FROM = 8e9
"""`offload_text_encoders: auto` offloads for trained networks of this many parameters and more."""


def encode_then_offload(policy, device, prompts=None) -> None:
    """Keep the text encoders in CPU memory and encode `prompts` (every prompt the run will see) with the encoders
    moved to `device` for the pass, wherever the trained network is (still in CPU memory when the run loads a network
    and text encoders that do not fit on the GPU together): each prompt is encoded once and then read from the
    cache; a prompt outside it later is encoded on demand."""
    policy.offload_text_encoders()
    if prompts:
        with policy.encoding_on(device):
            policy.encode(list(dict.fromkeys(str(p) for p in prompts)))
            policy.encode([policy.negative_prompt], negative=True)
