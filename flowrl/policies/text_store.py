"""Prompt conditioning kept on disk, and text encoders kept off the accelerator.

Frozen text encoders are a large share of a real model's memory (T5-XXL 4.7B beside SD3.5-M's 2.5B transformer;
Qwen2.5-VL 7B beside Qwen-Image) and are used only to encode each prompt once. `TextStore` writes each prompt's
conditioning tensors to a folder (one safetensors file per prompt, named by a hash of the key, written atomically),
so a later run, another process or `flowrl sample` reads them back instead of encoding; `offloaded_encoders` keeps
the pipeline's text encoders in CPU memory and moves them to the device only around an encode of prompts that are
in neither cache. Loading from the store gives the encoder's bits exactly (safetensors round-trips every dtype).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path

import torch

from flowrl.cache import write_file_atomic


class TextStore:
    """Per-prompt conditioning tensors in `folder` (created on first write)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def _path(self, key) -> Path:
        return self.folder / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.safetensors"

    def get(self, key) -> dict[str, torch.Tensor] | None:
        """The stored tensors of `key` (on the CPU), or None; an unreadable file counts as missing."""
        from safetensors.torch import load_file

        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return load_file(path)
        except Exception:  # a torn or foreign file: re-encode (and overwrite it)
            return None

    def put(self, key, tensors: dict[str, torch.Tensor]) -> None:
        """Store `tensors` for `key` (a temporary file renamed into place: readers never see half a file)."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        write_file_atomic(self._path(key), lambda tmp: save_file(tensors, tmp))


def text_encoders(pipeline) -> dict[str, torch.nn.Module]:
    """The pipeline's text encoders (`text_encoder`, `text_encoder_2`, ...)."""
    if pipeline is None:
        return {}
    return {
        name: module
        for name, module in pipeline.components.items()
        if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)
    }


def offload_encoders(pipeline) -> None:
    """Move the pipeline's text encoders to CPU memory."""
    for module in text_encoders(pipeline).values():
        module.to("cpu")


@contextmanager
def encoders_on(pipeline, device, offloaded: bool):
    """With `offloaded`, the text encoders on `device` for the block, back in CPU memory after it."""
    if not offloaded:
        yield
        return
    modules = text_encoders(pipeline).values()
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module in modules:
            module.to("cpu")
