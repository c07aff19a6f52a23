"""CLIP-family dual encoders behind one small interface, for the text-image similarity rewards.

`HFCLIP` wraps a transformers `CLIPModel` (OpenAI CLIP, PickScore, any CLIP checkpoint on the hub);
`OpenCLIP` wraps an `open_clip` model (any open_clip architecture or tag), an optional extra. Both expose
`encode_text(prompts)` and `encode_image(images)`, which return L2-normalised fp32 embeddings, and
`logit_scale` (the learned temperature, already exponentiated). Images go through `ImageSettings` in torch
ops, so `encode_image` is differentiable with respect to the pixels; text embeddings are computed once per
unique prompt and cached (the encoders are frozen).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from flowrl.rewards.loading import check_tokenizer, download_hint, load_pretrained
from flowrl.rewards.preprocess import ImageSettings, read_processor_config


class TextCache:
    """Normalised text embeddings per prompt (bounded, thread-safe), so each prompt is encoded once."""

    def __init__(self, encode: Callable[[list[str]], torch.Tensor], max_size: int = 4096):
        self._encode = encode
        self._store: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.max_size = max_size

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        with self._lock:
            missing = [p for p in dict.fromkeys(prompts) if p not in self._store]
            if missing:
                with torch.no_grad():
                    embeds = self._encode(missing)
                for prompt, embed in zip(missing, embeds):
                    self._store[prompt] = embed
            for prompt in prompts:
                self._store.move_to_end(prompt)
            out = torch.stack([self._store[p] for p in prompts])
            while len(self._store) > self.max_size:
                self._store.popitem(last=False)
        return out

    def clear(self) -> None:
        with self._lock:
            self._store.clear()


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True)


def download_fix(reward: str, repo: str, arg: str) -> str:
    config = f"`rewards: [{{name: {reward}, kwargs: {{{arg}: DIR}}}}]`"
    return f"run {download_hint(repo)} and pass {arg}=DIR (config: {config})"


def load_clip_model(reward: str, location, *, default_repo: str, arg: str = "model"):
    """A transformers `CLIPModel` from a hub id or local folder, or a `RewardWeightsError`."""
    from transformers import CLIPModel

    return load_pretrained(
        reward,
        CLIPModel.from_pretrained,
        location,
        what="CLIP model",
        needs=f"config.json and model.safetensors (or pytorch_model.bin) of {default_repo}",
        fix=download_fix(reward, default_repo, arg),
    )


class CLIPBackend(torch.nn.Module):
    """What the CLIP-based rewards use of a CLIP model, whichever library built it (`self.model`).

    Subclasses set `self.model` (with a `logit_scale` parameter) and `self.text = TextCache(self._encode_text)`,
    and define `_encode_text` (uncached, unit-norm) and `encode_image`.
    """

    model: torch.nn.Module
    text: TextCache

    @property
    def device(self) -> torch.device:
        return self.model.logit_scale.device

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.exp().float()

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """`[B, D]` unit-norm text embeddings (cached per prompt, no gradient)."""
        return self.text(list(prompts))


class HFCLIP(CLIPBackend):
    """A transformers `CLIPModel` with its tokenizer and image preprocessing.

    Args:
        reward (`str`): the reward's name, for error messages.
        model (`str` or `CLIPModel`): hub id or local folder of the CLIP weights, or a model already built (HPSv2
            converts open_clip weights into one).
        processor (`str`, *optional*): hub id or folder of the tokenizer and `preprocessor_config.json`
            (defaults to `model` when that is a location; PickScore takes them from
            `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`).
        default_repo, default_processor (`str`): hub ids named in error messages.
    """

    def __init__(
        self,
        reward: str,
        model: str | torch.nn.Module,
        processor: str | None = None,
        *,
        default_repo: str,
        default_processor: str | None = None,
        device=None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        from transformers import AutoTokenizer

        built = isinstance(model, torch.nn.Module)
        if built and processor is None:
            raise ValueError(f"reward {reward!r}: a CLIP model passed built needs the processor's location")
        processor = processor or model
        default_processor = default_processor or default_repo
        clip = model if built else load_clip_model(reward, model, default_repo=default_repo)
        self.model = clip.to(device=device, dtype=dtype).eval().requires_grad_(False)
        text_config, vision_config = clip.config.text_config, clip.config.vision_config
        fix = download_fix(reward, default_processor, "processor" if processor != model else "model")
        needs = f"the tokenizer files (tokenizer.json or vocab.json + merges.txt) of {default_processor}"
        tokenizer = load_pretrained(
            reward, AutoTokenizer.from_pretrained, processor, what="tokenizer", needs=needs, fix=fix
        )
        minimum = int(0.9 * text_config.vocab_size)
        self.tokenizer = check_tokenizer(reward, tokenizer, minimum=minimum, location=processor, needs=needs, fix=fix)
        self.max_length = min(int(self.tokenizer.model_max_length), int(text_config.max_position_embeddings))
        config = read_processor_config(processor)
        size = int(vision_config.image_size)
        self.image_settings = (
            ImageSettings.from_processor_config(config, size) if config else ImageSettings.square(size)
        )
        self.text = TextCache(self._encode_text)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        out = self.model.text_model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        return unit_norm(self.model.text_projection(out.pooler_output))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """`[B, D]` unit-norm image embeddings of `[B, 3, H, W]` images in [0, 1] (differentiable)."""
        pixels = self.image_settings(images.to(self.device)).to(self.model.dtype)
        out = self.model.vision_model(pixel_values=pixels)
        return unit_norm(self.model.visual_projection(out.pooler_output))
