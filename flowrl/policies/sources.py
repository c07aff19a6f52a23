"""Conditioning images: what a sample is conditioned on besides its prompt, the source images of an editing model
(FLUX.1 Kontext, Qwen-Image-Edit) or the start frame of an image-to-video model (Wan I2V, HunyuanVideo 1.5 I2V,
LTX-2). One mechanism serves both (`ModelAdapter.conditioning` says which the family's images are).

A conditioned sample is a pair (prompt, images). `DiffusionPolicy.rollout(prompts, source_images=...)` takes one entry
per prompt: a path, a PIL image, a `[3, H, W]` tensor in [0, 1], or a sequence of those (several images). The policy
keeps a cache of the pairs' conditioning beside its per-prompt text cache: each distinct pair is prepared
(`ModelAdapter.prepare_sources`: resized as the pipeline resizes, `[N, 3, H, W]` in [0, 1]; an image-to-video family,
`conditions_at_size`, at the video's size) and encoded (`ModelAdapter.encode_sources`: e.g. FLUX.1 Kontext's packed VAE
latents and their image ids, Wan I2V's masked first-frame latents and CLIP image embeddings) once and alone, so a
pair's tensors never depend on the batch it came in. A rollout records each sample's pair (`edit_ids`), the pairs'
conditioning and the prepared images, so re-scoring uses the same condition and rewards read the same pixels
(`source_images [B, N, 3, H, W]`: an edit's sources, or a video's start frame).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


NEGATIVE = "negative:"
"""Prefix of a pair's conditioning for the unconditional branch (families whose negative prompt sees the sources:
`ModelAdapter.negative_sees_sources`); the CFG plan puts `negative:<key>` in the unconditional half for `<key>`."""


def as_sources(entry) -> list:
    """One sample's source images as a list (a single image, or a sequence of them; `None`/empty: no source)."""
    if entry is None:
        return []
    if isinstance(entry, (str, Path, torch.Tensor)) or hasattr(entry, "convert"):  # path, tensor or PIL image
        return [entry]
    return list(entry)


def load_source(image):
    """A path as an RGB PIL image (`diffusers.utils.load_image`: EXIF orientation applied); an image as it is."""
    if isinstance(image, (str, Path)):
        from diffusers.utils import load_image

        return load_image(str(image))
    return image


def source_key(image) -> str:
    """A key that identifies one source image: its resolved path, or a hash of its pixels."""
    if isinstance(image, (str, Path)):
        return f"path:{Path(image).expanduser().resolve()}"
    if isinstance(image, torch.Tensor):
        data = image.detach().float().cpu().contiguous()
        return f"pt:{tuple(data.shape)}:{hashlib.sha1(data.numpy().tobytes()).hexdigest()}"
    if hasattr(image, "tobytes"):  # PIL
        digest = hashlib.sha1(image.tobytes()).hexdigest()
        return f"pil:{image.mode}:{image.size[0]}x{image.size[1]}:{digest}"
    raise TypeError(f"a source image must be a path, a PIL image or a [3, H, W] tensor, not {type(image).__name__}")


def edit_key(prompt: str, sources: Sequence, size: tuple[int, int] | None = None) -> str:
    """The key of one (prompt, conditioning images) pair: the unit a rollout's conditioning and groups are keyed on
    (with the sample's `size` when the images are prepared at it: `ModelAdapter.conditions_at_size`)."""
    return "\x00".join([prompt, *(source_key(s) for s in sources), *([f"size:{size[0]}x{size[1]}"] if size else [])])


@dataclass
class EditBatch:
    """The (prompt, source images) pairs of a batch of samples."""

    ids: torch.Tensor
    """`[B]` each sample's pair: its index in `keys`."""
    keys: list[str]
    """Distinct pairs in order of first appearance (`edit_key`)."""
    cond: dict[str, torch.Tensor]
    """The pairs' conditioning, `[S, ...]` each (`ModelAdapter.encode_sources`)."""
    pixels: torch.Tensor
    """`[S, N, 3, H, W]` the pairs' source images in [0, 1] as the model saw them (CPU, fp32)."""

    def rollout_fields(self) -> dict:
        """The `DiffusionRollout` fields that record the pairs."""
        return {"edit_ids": self.ids, "edit_keys": self.keys, "edit_cond": self.cond, "source_pixels": self.pixels}


class SourceConditioning:
    """The source-image part of `DiffusionPolicy` (a mixin: it reads the policy's `adapter` and keeps
    `_source_cache`)."""

    def encode_edits(
        self, prompts: Sequence[str], source_images: Sequence, size: tuple[int, int] | None = None
    ) -> EditBatch:
        """The conditioning of each sample's (prompt, conditioning images) pair, each distinct pair encoded once,
        alone (batch of one), and cached: its tensors never depend on the batch.

        Args:
            prompts (`Sequence[str]`): `B` prompts.
            source_images (`Sequence`): `B` entries (see the module docstring); every entry needs at least one image,
                and all must prepare to the same shape (set the family's condition size when their sizes differ).
            size (`tuple[int, int]`, *optional*): the samples' `(height, width)`, where the family prepares its
                images at it (`conditions_at_size`: image-to-video).
        """
        if len(source_images) != len(prompts):
            raise ValueError(f"source_images has {len(source_images)} entries for {len(prompts)} prompts")
        entries = [as_sources(e) for e in source_images]
        if any(not e for e in entries):
            kind = "start image" if self.adapter.conditioning == "start_frame" else "source image"
            raise ValueError(f"every sample of a {self.family} rollout needs a {kind}")
        at_size = size if self.adapter.conditions_at_size else None
        if self.adapter.conditions_at_size and size is None:
            raise ValueError(f"{self.family} prepares its conditioning images at the sample's size: pass size")
        keys = [edit_key(p, e, at_size) for p, e in zip(prompts, entries)]
        unique = list(dict.fromkeys(keys))
        with torch.no_grad():
            for key, prompt, entry in zip(keys, prompts, entries):
                if key not in self._source_cache:
                    sized = {} if at_size is None else {"size": tuple(at_size)}
                    pixels, pre = self.adapter.prepare_sources([load_source(s) for s in entry], **sized)
                    cond = self.adapter.encode_sources(prompt, pre)
                    if self.adapter.negative_sees_sources:  # the unconditional branch of this pair
                        negative = self.adapter.encode_source_text(self.negative_prompt, pre)
                        cond.update({NEGATIVE + k: v for k, v in negative.items()})
                    self._source_cache[key] = (pixels.float().cpu(), cond)
        shapes = {tuple(self._source_cache[k][0].shape) for k in unique}
        if len(shapes) > 1:
            raise ValueError(
                f"the source images of one rollout prepare to different shapes {sorted(shapes)}; "
                "resize them to one size (e.g. the family's `condition_size` option)"
            )
        position = {k: i for i, k in enumerate(unique)}
        names = self._source_cache[unique[0]][1]
        cond = {n: torch.stack([self._source_cache[k][1][n] for k in unique]) for n in names}
        pixels = torch.stack([self._source_cache[k][0] for k in unique])
        return EditBatch(ids=torch.tensor([position[k] for k in keys]), keys=unique, cond=cond, pixels=pixels)

    def clear_source_cache(self) -> None:
        self._source_cache.clear()
