"""What several model families share, written once: guidance, text-length and VAE helpers, the pipelines'
resolution-dependent shift `mu`, the call of a Flux-style transformer on packed tokens, the DDIM schedule, per-prompt
text rows at a fixed shape (and the network called per text length), a component loaded from its subfolder and
Qwen-VL processors without their video slot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def guidance_embedding(model, guidance_scale: float, n: int, device) -> torch.Tensor | None:
    """`[n]` fp32 guidance for a guidance-distilled transformer (Flux.1, Kontext, FLUX.2 dev: the scale goes to its
    guidance embedding), or None when `model` has none. `model` is the bare network: a DDP wrapper has no config."""
    if not model.config.get("guidance_embeds", False):
        return None
    return torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(n)


def text_kwargs(options) -> dict:
    """`encode_prompt`'s `max_sequence_length` when the options set one."""
    length = getattr(options, "max_sequence_length", None)
    return {} if length is None else {"max_sequence_length": length}


def decode_vae(pipeline, latents, shift: bool = True) -> torch.Tensor:
    """Latents through the pipeline's VAE (scaling, optional shift) to images `[B, 3, H, W]` in [0, 1]."""
    vae = pipeline.vae
    latents = latents.to(vae.dtype) / vae.config.scaling_factor
    if shift and vae.config.get("shift_factor") is not None:
        latents = latents + vae.config.shift_factor
    image = vae.decode(latents, return_dict=False)[0]
    return pipeline.image_processor.postprocess(image, output_type="pt")


def calculate_shift(config, image_seq_len: int, max_shift: float = 1.15) -> float:
    """The shift `mu` for `image_seq_len` image tokens, as the pipelines' `calculate_shift`: linear from `base_shift`
    at `base_image_seq_len` tokens to `max_shift` at `max_image_seq_len`, each read from the scheduler `config`, else
    the pipeline's fallback: 256, 4096, 0.5 and `max_shift` (1.15 in FLUX.1, FLUX.1 Kontext, Qwen-Image(-Edit),
    Qwen-Image 2.1 and Z-Image; 1.16 in SD3, diffusers 0.42.1). The arithmetic is the pipelines', in their order."""
    base_seq_len = config.get("base_image_seq_len", 256)
    max_seq_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    m = (config.get("max_shift", max_shift) - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def dynamic_shift(config, image_seq_len: int, max_shift: float = 1.15) -> float | None:
    """`calculate_shift` when the scheduler shifts by resolution (`use_dynamic_shifting`), else None (its static
    `shift`): what `ModelAdapter.shift_mu` returns."""
    if not config.get("use_dynamic_shifting", None):
        return None
    return calculate_shift(config, image_seq_len, max_shift)


def flux_forward(model, latents, timesteps, guidance, image_latents=None, **inputs) -> torch.Tensor:
    """One call of a Flux-style transformer (FLUX.1, Kontext, Qwen-Image(-Edit), FLUX.2) on packed tokens
    `latents [N, S, C]`: the timestep as sigma (`t / 1000`) and `guidance` (`guidance_embedding`, or None) with the
    family's other `inputs`. An editing family's source tokens `image_latents [N, S', C]` go after the noisy ones, and
    the prediction is the first `S` tokens."""
    tokens = latents.shape[1]
    hidden = latents if image_latents is None else torch.cat([latents, image_latents.to(latents.dtype)], dim=1)
    out = model(
        hidden_states=hidden,
        timestep=timesteps.to(latents.dtype) / 1000,
        guidance=guidance,
        return_dict=False,
        **inputs,
    )[0]
    return out if image_latents is None else out[:, :tokens]


def ddim_schedule(scheduler, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `DDIMScheduler`'s schedule as `ModelAdapter.schedule` returns it: `(timesteps [T], sigmas [T + 1])`, on the
    CPU, `sigmas` the flow-matching noise levels with the same signal-to-noise ratios as the DDIM steps' alphas
    (`sqrt(1 - a) / (sqrt(a) + sqrt(1 - a))`), the last one the alpha after the final step (`final_alpha_cumprod`
    past the schedule's start)."""
    scheduler.set_timesteps(num_steps, device="cpu")
    timesteps = scheduler.timesteps
    alphas = scheduler.alphas_cumprod.to(torch.float32)
    last = int(timesteps[-1]) - scheduler.config.num_train_timesteps // num_steps
    final = alphas[last] if last >= 0 else torch.as_tensor(scheduler.final_alpha_cumprod, dtype=torch.float32)
    alpha_bar = torch.cat([alphas[timesteps.cpu()], final.reshape(1)])  # [T + 1]
    # the flow-matching noise level with the same signal-to-noise ratio: x_t / (sqrt(a) + sqrt(1 - a))
    sigmas = (1 - alpha_bar).sqrt() / (alpha_bar.sqrt() + (1 - alpha_bar).sqrt())
    return timesteps, sigmas


def pad_rows(rows: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt text embeddings `rows` (`[L_i, D]` each, a prompt's own tokens) zero-padded to `[P, length, D]`,
    and their token counts `[P]` on the host (what `per_text_length` groups by): a prompt's conditioning at a fixed
    shape that does not depend on the prompts batched with it."""
    padded = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return padded, torch.tensor([len(row) for row in rows], dtype=torch.long)


def per_text_length(latents: torch.Tensor, lengths: list[int], predict: Callable) -> torch.Tensor:
    """The prediction `[N, ...]` for `latents [N, ...]` from one network call per distinct text length: `predict(rows,
    length)` gets the rows (a device index tensor) whose prompt has `length` tokens (`pad_rows`'s counts) and returns
    their prediction, as the pipeline's call for prompts of that one length (a family whose positions follow the
    text, and whose pipeline pads a batch's prompts to the longest without a mask)."""
    out = torch.empty_like(latents)
    for length in sorted(set(lengths)):
        rows = torch.tensor([i for i, n in enumerate(lengths) if n == length], device=latents.device)
        out = out.index_copy(0, rows, predict(rows, length).to(out.dtype))
    return out


def load_component(cls, name_or_path: str, subfolder: str):
    """`cls.from_pretrained` of a pipeline's `subfolder` component, from a pipeline folder or a hub id (for a
    component a family loads itself: a processor without the video processor that needs torchvision)."""
    path = Path(name_or_path).expanduser()
    source = str(path / subfolder) if path.is_dir() else str(name_or_path)
    kwargs = {} if path.is_dir() else {"subfolder": subfolder}
    return cls.from_pretrained(source, **kwargs)


def processor_without_video(base: str) -> type:
    """transformers' Qwen-VL processor class `base` (`"Qwen2VLProcessor"`, `"Qwen3VLProcessor"`) without its video
    slot, under the same name (saved pipelines name `transformers.<base>`).

    The processor's constructor requires a video processor, which transformers builds only with torchvision (not
    installed beside CPU torch). The pipelines never pass videos: this subclass has an image processor and a
    tokenizer only, its special tokens set by the base class's rule (the tokenizer's own, else Qwen's), and otherwise
    is the same processor (same prompt expansion, same pixel values). Built on first use, so transformers is imported
    only when a family that needs it is."""
    if base not in _PROCESSORS:
        import transformers
        from transformers.processing_utils import ProcessorMixin

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            for name, default in _QWEN_VL_TOKENS:
                setattr(self, name, getattr(tokenizer, name, None) or default)
                setattr(self, f"{name}_id", tokenizer.convert_tokens_to_ids(getattr(self, name)))
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        doc = f"`{base}` with no video processor (`flowrl.models.helpers.processor_without_video`)."
        cls = type(base, (getattr(transformers, base),), {"__init__": __init__, "__doc__": doc})
        cls.__module__ = "transformers"
        _PROCESSORS[base] = cls
    return _PROCESSORS[base]


_PROCESSORS: dict[str, type] = {}

_QWEN_VL_TOKENS = (
    ("image_token", "<|image_pad|>"),
    ("video_token", "<|video_pad|>"),
    ("vision_start_token", "<|vision_start|>"),
    ("vision_end_token", "<|vision_end|>"),
)
"""The Qwen-VL processors' special tokens (Qwen2-VL's uses the first two) and their defaults."""
