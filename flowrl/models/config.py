"""The `model` section of image and video runs: which network, its dtype, LoRA and the family's own options."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal


@dataclasses.dataclass
class ModelConfig:
    name: str = "digits"
    """`digits` (the embedded offline world), or a diffusers hub id / local folder of a registered family
    (`flowrl list model_families`)."""
    family: str | None = None
    """Model family for hub ids (`sd3`, `flux`, `unet`, ...: `flowrl list model_families`); detected from
    `model_index.json` for folders."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Weights dtype (bf16 for SD3.5/Flux on GPU; log-prob math is fp32 regardless)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The family's own options (its `Options` dataclass, `docs/policies.md`): `max_sequence_length` (text tokens
    for T5: SD3 256, Flux 512 by default), ..."""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float | None = None
    """LoRA alpha (defaults to the rank; Flow-GRPO uses rank 32, alpha 64)."""
    lora_targets: list[str] | None = None
    """LoRA target modules (defaults: the attention projections of the family)."""
    lora_dtype: Literal["fp32", "bf16"] = "fp32"
    """The LoRA weights' dtype: `fp32` (the optimizer steps fp32 weights; the adapter's arithmetic follows the run's
    mixed precision) or `bf16` (Flow-Factory's way: half the adapter's and its optimizer's memory, but AdamW's
    updates are rounded to bf16's 8 bits). Under mixed precision the adapted layers' inputs are never cast to the
    adapter's dtype (peft's default cast would keep an fp32 copy of each input and a bf16 copy of it for the
    backward: autocast computes the adapter in bf16 either way, bit for bit the same)."""
    gradient_checkpointing: bool | float = False
    """Recompute activations in the backward pass (less memory, more time): true for every block of the network, a
    fraction in (0, 1) for that share of its blocks, evenly spread (selective: the memory of the others' activations
    for the compute of not recomputing them; `flowrl plan` shows what fits)."""
    cache_text: bool = False
    """Store each prompt's conditioning on disk (`$FLOWRL_CACHE/text/<model key>`): later runs, other processes and
    `flowrl sample` read it instead of running the text encoders (bit-identical)."""
    offload_text_encoders: bool | Literal["auto"] = "auto"
    """Keep the frozen text encoders in CPU memory: every prompt of the train and test sets is encoded once at the
    start (or read from `cache_text`), before the trained network moves to the device, and an unseen prompt moves
    them to the device for its encode only. `auto`: for networks of 8B parameters and more (FLUX, Qwen-Image,
    FLUX.2, Wan 14B, HunyuanVideo, SD3.5-Large), on a GPU."""
    compile: bool = False
    """Compile the network's repeated blocks with `torch.compile` (diffusers' regional compilation,
    `compile_repeated_blocks`): faster steps after a compilation at start-up. Rollouts and training run different
    compiled graphs, so the ratio at the old weights is 1 up to the kernels' rounding (docs/models.md: measured
    against the clip ranges), not bit for bit."""
    attention_backend: str | None = "auto"
    """diffusers' attention backend for the trained network: `auto` (off CUDA diffusers' default, untouched; on CUDA
    the best kernel for the GPU and the family that passes a start-up self-test, never PyTorch's cuDNN SDPA:
    `flowrl.models.attention`, docs/models.md), a diffusers backend set as given (`set_attention_backend`: `native`,
    `flash`, `_native_flash`, `xformers`, ...), or None (diffusers' default, untouched). The rollout and the update
    use the same one, so the ratio stays exactly 1."""
    digits_pretrain_steps: int = 220
    """Digits world only: pretraining steps of the base model (few, so RL has headroom)."""

    def __post_init__(self):
        checkpointing = self.gradient_checkpointing
        if not isinstance(checkpointing, bool) and not 0 < checkpointing <= 1:
            raise ValueError(
                f"model.gradient_checkpointing must be true, false or a fraction of the blocks in (0, 1], "
                f"got {checkpointing}"
            )
        if self.attention_backend not in (None, "auto"):
            from diffusers.models.attention_dispatch import AttentionBackendName

            valid = ["auto"] + [b.value for b in AttentionBackendName]
            if self.attention_backend not in valid:
                raise ValueError(
                    f"model.attention_backend {self.attention_backend!r} is not one of diffusers' "
                    f"backends or auto: {', '.join(valid)}"
                )
        if self.family is not None:
            from flowrl.models.families import family_options

            family_options(self.family, self.options)  # an unknown family or option fails naming the valid ones
