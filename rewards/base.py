"""The reward base class: batching, `no_grad`, device/dtype handling and output checking in one place."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from flowrl.rewards import check_output


DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def as_dtype(dtype) -> torch.dtype:
    """A `torch.dtype` from a dtype or its name (`"bf16"`, `"float16"`, ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Reward(ABC):
    """A reward model. Subclasses implement `score`; calling the instance runs it safely.

    `reward(images, prompts, **metadata)` splits the batch into chunks of `batch_size`, runs `score` under
    `torch.no_grad()` on `device` in `dtype`, checks the output (`[B]` numbers, named errors) and returns a
    float32 CPU tensor. `score(images, prompts, **metadata)` is the raw computation: differentiable rewards
    (`differentiable = True`) keep the graph to the pixels there.

    Args:
        device (`str` or `torch.device`, *optional*): where the reward model runs (default: CPU).
        dtype (`torch.dtype` or `str`, defaults to fp32): the reward model's dtype (`"bf16"`, `"fp16"`, ... from
            YAML configs).
        batch_size (`int`, defaults to 32): images per `score` call.
    """

    name: str = "reward"
    differentiable: bool = False
    video: bool = False
    """Scores videos `[B, 3, F, H, W]` itself (`flowrl.rewards.video`); an image reward given videos scores every frame
    and averages (`flowrl.rewards.video.score_frames`)."""
    needs_source_images: bool = False
    """Editing: the reward is also given each sample's source images as `source_images [B, N, 3, H, W]` in [0, 1]
    (`flowrl.rewards.edit`); rewards without it never see them."""

    def __init__(self, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device or "cpu")
        self.dtype = as_dtype(dtype)
        self.batch_size = batch_size

    @abstractmethod
    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        """Scores `[B]` of `images [B, 3, H, W]` in [0, 1] (on `self.device`) for `prompts`."""

    def __call__(self, images: torch.Tensor, prompts, **metadata) -> torch.Tensor:
        if images.ndim == 5 and not self.video:  # videos [B, 3, F, H, W]: every frame scored, the mean per video
            from flowrl.rewards.video import score_frames

            return score_frames(self, images, prompts, name=self.name, **metadata)
        if self.video and (images.ndim != 5 or images.shape[1] != 3):
            raise ValueError(f"reward {self.name!r} needs videos [B, 3, F, H, W] in [0, 1]; got {tuple(images.shape)}")
        if not self.video and (images.ndim != 4 or images.shape[1] != 3):
            raise ValueError(f"reward {self.name!r} needs images [B, 3, H, W] in [0, 1]; got {tuple(images.shape)}")
        prompts = list(prompts)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {self.name!r} got {images.shape[0]} images but {len(prompts)} prompts")
        out = []
        with torch.no_grad():
            for start in range(0, len(prompts), self.batch_size):
                end = start + self.batch_size
                chunk_meta = {
                    k: v[start:end] if isinstance(v, (list, tuple, torch.Tensor)) else v for k, v in metadata.items()
                }
                chunk = images[start:end].to(self.device, self.dtype)
                out.append(check_output(self.name, self.score(chunk, prompts[start:end], **chunk_meta), len(chunk)))
        return torch.cat(out) if out else torch.zeros(0)
