"""Offline preference data: a JSONL file of (prompt, chosen image, rejected image) rows, and its epoch collector.

The format (`docs/algorithms/diffusion_dpo.md`): one JSON object per line,

    {"prompt": "a handwritten seven", "chosen": "images/00000_chosen.png", "rejected": "images/00000_rejected.png"}

with image paths relative to the JSONL file (absolute paths work too); blank lines and lines starting with `#` are
skipped, and other keys are ignored. `load_preferences` reads it, failing on the first bad row with a one-line
error that names the file and line. `PreferenceCollector` serves it to the loop as an epoch of "samples": each
epoch's pairs are drawn from `(seed, epoch)` without replacement (cycling through reshuffles, as prompts are), every
pair becomes two rows (chosen, then rejected) whose final latents are the images encoded by the model family
(`ModelAdapter.encode_images`), with preference labels 1 and 0 as their reward.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from flowrl.policies.diffusion import DiffusionRollout
from flowrl.policies.rollout import Collected
from flowrl.prompts import epoch_prompts


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One row of a preference file: the prompt and its chosen and rejected images (resolved paths)."""

    prompt: str
    chosen: Path
    rejected: Path


KEYS = ("prompt", "chosen", "rejected")


def load_preferences(path: str | Path) -> list[PreferencePair]:
    """The pairs of a preference JSONL file (see the module docstring); `ValueError` on the first bad row."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"preference data {path} does not exist (the digits example: python -m "
            "flowrl.digits.preferences DIR builds DIR/preferences.jsonl)"
        )
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object with {', '.join(KEYS)}")
        missing = [k for k in KEYS if not isinstance(row.get(k), str) or not row[k].strip()]
        if missing:
            raise ValueError(f"{where}: needs a non-empty string for {', '.join(repr(k) for k in missing)}")
        images = {}
        for key in ("chosen", "rejected"):
            image = Path(row[key]) if Path(row[key]).is_absolute() else path.parent / row[key]
            if not image.is_file():
                raise ValueError(f"{where}: {key} image {row[key]!r} does not exist ({image})")
            images[key] = image
        pairs.append(PreferencePair(row["prompt"], images["chosen"], images["rejected"]))
    if not pairs:
        raise ValueError(f"preference data {path} holds no pairs")
    return pairs


def read_image(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """The image at `path` as `[3, H, W]` in [0, 1] at `size` `(H, W)` (resized with antialiasing if it differs)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            pixels = torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8)
            width, height = image.size
    except OSError as err:
        raise ValueError(f"cannot read image {path}: {err}") from None
    image = pixels.reshape(height, width, 3).permute(2, 0, 1).float() / 255  # [3, h, w]
    if (height, width) != tuple(size):
        image = torch.nn.functional.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True)[0]
    return image.clamp(0, 1)


class PreferenceCollector:
    """An epoch of a preference file's pairs as rows of a rollout (see the module docstring).

    Args:
        policy (`DiffusionPolicy`): encodes the prompts and the images.
        pairs (`list[PreferencePair]`): the data (`load_preferences`).
        processes (`Processes`): this process's share.
        pairs_per_epoch (`int`): pairs per epoch over every process (`prompts.prompts_per_epoch`).
        seed (`int`): `run.seed`.
        num_steps (`int`): the sampler's steps (the rows carry its noise-level grid for `t_sampling: grid`).
        height, width (`int`, *optional*): the image size (default: the model's).
    """

    def __init__(
        self,
        *,
        policy,
        pairs: list[PreferencePair],
        processes,
        pairs_per_epoch: int,
        seed: int,
        num_steps: int,
        height: int | None = None,
        width: int | None = None,
    ):
        self.policy, self.pairs, self.processes = policy, pairs, processes
        self.m, self.seed, self.num_steps = pairs_per_epoch, seed, num_steps
        default_h, default_w = policy.adapter.default_size()
        self.size = (height or default_h, width or default_w)
        self._images: dict[Path, torch.Tensor] = {}

    def image(self, path: Path) -> torch.Tensor:
        if path not in self._images:  # each file is read once per run
            self._images[path] = read_image(path, self.size)
        return self._images[path]

    def collect(self, epoch: int) -> Collected:
        start = time.time()
        chosen = epoch_prompts(self.pairs, self.m, 2, self.seed, epoch)  # [2m] each pair twice: chosen, rejected
        prompts = [pair.prompt for pair in chosen]
        local = self.processes.local_slice(len(chosen))
        positions = range(local.start, local.stop)
        paths = [chosen[i].chosen if i % 2 == 0 else chosen[i].rejected for i in positions]
        images = torch.stack([self.image(p) for p in paths])  # [b, 3, H, W]
        labels = torch.tensor([1.0 if i % 2 == 0 else 0.0 for i in range(len(chosen))])  # [2m]
        rollout = self.rollout(prompts[local], images)
        return Collected(
            data=rollout,
            rows=torch.arange(local.start, local.stop),
            size=len(chosen),
            prompts=prompts,
            rewards={"preference": labels},
            total=labels.clone(),
            times={"time/sample_s": time.time() - start},
        )

    @torch.no_grad()
    def rollout(self, prompts: list[str], images: torch.Tensor) -> DiffusionRollout:
        """A rollout record of the given final images (one state: `latents [b, 1, ...]`, no steps)."""
        policy = self.policy
        latents = policy.adapter.encode_images(images.to(policy.device))  # [b, ...]
        unique = list(dict.fromkeys(prompts))
        timesteps, sigmas = policy.adapter.schedule(self.num_steps, latents.shape)
        b = len(prompts)
        height, width = self.size
        return DiffusionRollout(
            prompts=list(prompts),
            prompt_ids=torch.tensor([unique.index(p) for p in prompts]),
            unique_prompts=unique,
            latents=latents[:, None],
            log_probs=torch.zeros(b, 0),
            sde_mask=torch.zeros(0, dtype=torch.bool),
            timesteps=timesteps,
            sigmas=sigmas,
            stds=torch.zeros(0),
            cond=policy.encode(unique),
            sampler="offline",
            guidance_scale=1.0,
            forward_batch_size=policy.forward_batch_size or b,
            reduce=policy.reduce,
            height=height,
            width=width,
            static=policy.adapter.static_inputs(height, width),
            images=images.cpu(),
        )
