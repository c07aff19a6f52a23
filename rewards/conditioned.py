"""Rewards for conditioned video (image-to-video): what a video must keep of its start frame, and that it moves.

An image-to-video sample comes with its start image as a conditioning image (`flowrl.policies.sources`); rewards
that set `needs_source_images` receive it as `source_images [B, N, 3, H, W]` in [0, 1] (the image as the model saw
it; `flowrl score ... --image START.png` passes one by hand). Videos are `[B, 3, F, H, W]` in [0, 1].

- `first_frame_fidelity`: pixels, `1 - mean |frame - start|` over the first `frames` frames;
- `first_frame_similarity`: CLIP image embeddings, the cosine of the first `frames` frames' with the start image's;
- `motion`: how much consecutive frames change, capped at a target, so a frozen video scores 0: beside
  `temporal_consistency` (which alone is maximised by a still video) the pair has its best at smooth motion;
- `vlm_i2v`: the VLM judge (`flowrl.rewards.vlm_judges`) shown the start frame before the video's frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowrl.rewards import register
from flowrl.rewards.base import Reward
from flowrl.rewards.video import frame_indices
from flowrl.rewards.vlm_judges import Question, VlmVideo, _fill


def start_frames(source_images, videos: torch.Tensor, name: str) -> torch.Tensor:
    """`[B, 3, H, W]`: each sample's start image (its first conditioning image) at the videos' frame size (bilinear,
    antialiased, when the sizes differ)."""
    if source_images is None:
        raise ValueError(
            f"reward {name!r} compares videos with their start images: use an image-to-video prompt set "
            "(rows with `image`, or `motion_shapes/train`) on an image-to-video model, or "
            "`flowrl score ... --image START.png`"
        )
    start = source_images[:, 0].to(videos.device, torch.float32)
    if start.shape[-2:] != videos.shape[-2:]:
        start = F.interpolate(start, size=videos.shape[-2:], mode="bilinear", antialias=True, align_corners=False)
    return start.clamp(0, 1)


def _check_frames(frames: int, name: str) -> int:
    if frames < 1:
        raise ValueError(f"reward {name!r}: frames must be >= 1, got {frames}")
    return int(frames)


@register("first_frame_fidelity")
class FirstFrameFidelity(Reward):
    """Image-to-video: 1 - mean |frame - start image| over the first frames (needs: nothing).

    `score[b] = 1 - mean_{f < frames} mean_{c,h,w} |video[b, :, f] - start[b]|`, in [0, 1] for pixels in [0, 1] (the
    start image resized to the frames' size when they differ): 1 when the video starts exactly on its start image.

    Args:
        frames (`int`, defaults to 1): the leading frames compared with the start image.
        device, dtype, batch_size: see `Reward`.
    """

    video = True
    needs_source_images = True

    def __init__(self, frames: int = 1, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 64):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.frames = _check_frames(frames, self.name)

    def score(self, images, prompts, source_images=None, **metadata):
        videos = images.float()
        start = start_frames(source_images, videos[:, :, 0], self.name)  # [B, 3, H, W]
        lead = videos[:, :, : self.frames]  # [B, 3, f, H, W]
        return 1.0 - (lead - start[:, :, None]).abs().mean(dim=(1, 2, 3, 4))


@register(
    "first_frame_similarity",
    description="Image-to-video: cosine of CLIP image embeddings of the first frame(s) and the start image "
    "(needs: openai/clip-vit-large-patch14, or any CLIPModel folder)",
)
class FirstFrameSimilarity(Reward):
    """Image-to-video: the cosine similarity of CLIP image embeddings of the first `frames` frames and the start image.

    `score[b] = mean_{f < frames} <E(video[b, :, f]), E(start[b])>` with unit-norm CLIP image embeddings `E` (the
    image tower and projection of a transformers `CLIPModel`), in [-1, 1]: 1 for the start image itself. It measures
    what the start frame shows (subjects, layout, style) rather than its exact pixels (`first_frame_fidelity`).

    Args:
        model (`str`, defaults to `"openai/clip-vit-large-patch14"`): hub id or local folder of a `CLIPModel`.
        frames (`int`, defaults to 1): the leading frames compared with the start image.
        processor (`str`, *optional*): folder/hub id of `preprocessor_config.json` when not next to the weights.
        device, dtype, batch_size: see `Reward`.
    """

    video = True
    needs_source_images = True

    def __init__(
        self,
        model: str | None = None,
        frames: int = 1,
        processor: str | None = None,
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        from flowrl.rewards.clip_models import HFCLIP
        from flowrl.rewards.clip_score import CLIP_REPO

        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.frames = _check_frames(frames, self.name)
        self.clip = HFCLIP(
            self.name, model or CLIP_REPO, processor, default_repo=CLIP_REPO, device=self.device, dtype=self.dtype
        )

    def score(self, images, prompts, source_images=None, **metadata):
        videos = images.float()
        start = start_frames(source_images, videos[:, :, 0], self.name)
        f = min(self.frames, videos.shape[2])
        lead = videos[:, :, :f].transpose(1, 2).flatten(0, 1)  # [B f, 3, H, W], sample-major
        frames = self.clip.encode_image(lead.to(self.dtype)).view(len(videos), f, -1)
        return (frames * self.clip.encode_image(start.to(self.dtype))[:, None]).sum(-1).mean(1)


@register("motion")
class Motion(Reward):
    """Videos: how much consecutive frames change, `min(1, m / target)` (0 for a still video; needs: nothing).

    `m[b] = mean_{f < F-1} mean_{c,h,w} |video[b, :, f+1] - video[b, :, f]|` (the complement of
    `temporal_consistency`'s `1 - m`), `score[b] = min(1, m[b] / target)`: rewards motion up to `target` and nothing
    beyond it, so it cannot be gamed by flicker once met, while a frozen video scores 0 (a one-frame video too).
    Beside `temporal_consistency` (which alone is maximised by a still video) the pair prefers about `target` of
    smooth change per frame.

    Args:
        target (`float`, defaults to 0.02): the mean absolute change per frame step (pixels in [0, 1]) that scores 1
            (flowrl's choice: a 64 px shape moving ~2 px a frame on a plain background changes ~2% of a frame).
        device, dtype, batch_size: see `Reward`.
    """

    video = True

    def __init__(self, target: float = 0.02, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 64):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if not target > 0:
            raise ValueError(f"reward 'motion': target must be > 0, got {target}")
        self.target = float(target)

    def score(self, images, prompts, **metadata):
        videos = images.float()
        if videos.shape[2] < 2:
            return torch.zeros(videos.shape[0])
        change = (videos[:, :, 1:] - videos[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4))
        return (change / self.target).clamp(max=1.0)


@register("vlm_i2v")
class VlmImageToVideo(VlmVideo):
    """Image-to-video: a VLM judges the start frame, then the video's frames (needs: a multi-image VLM server).

    Sends the start image (`source_images[:, 0]`), then the video's frames (`flowrl.rewards.video.frame_indices`,
    first and last included) in order, then `TEMPLATES["i2v"]` (fidelity to the start frame, caption alignment,
    quality and coherence; 1-5 after `Final Score:`, divided by 5) or `TEMPLATES["i2v_yes_no"]`; `{frames}` in a
    template is the number of video frames. Arguments: those of `vlm_video`.
    """

    needs_source_images = True
    default_template = {"score": "i2v", "yes_no": "i2v_yes_no"}

    def questions(self, images, prompts, source_images=None, **metadata) -> list[Question]:
        start = start_frames(source_images, images[:, :, 0], self.name)
        index = frame_indices(images.shape[2], self.frames)
        return [
            Question(
                (self.pixels(first), *(self.pixels(video[:, f]) for f in index.tolist())),
                _fill(self.template, prompt=p, frames=len(index)),
                self.system,
            )
            for video, first, p in zip(images, start, prompts)
        ]
