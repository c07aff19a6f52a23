"""Rewards on videos `[B, 3, F, H, W]` in [0, 1] (images are `[B, 3, H, W]`; video rollouts, e.g. Wan, decode to the
former). An image reward scores a video frame by frame and averages (`score_frames`: what every `Reward` does with
5-D input; `per_frame` for any other callable or a subset of frames); `temporal_consistency` measures how much
consecutive frames agree. None needs weights of its own.
"""

from __future__ import annotations

import torch

from flowrl.rewards import check_output, register
from flowrl.rewards.base import Reward


def frame_indices(num_frames: int, max_frames: int | None) -> torch.Tensor:
    """At most `max_frames` evenly spaced frame indices of `num_frames` (first and last included; None: all)."""
    if max_frames is None or max_frames >= num_frames:
        return torch.arange(num_frames)
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    return torch.linspace(0, num_frames - 1, max_frames).round().long()


def score_frames(
    reward, videos: torch.Tensor, prompts, *, max_frames: int | None = None, name: str = "per_frame", **metadata
) -> torch.Tensor:
    """`[B]`: the mean over frames of the image reward `reward(images [N, 3, H, W], prompts, **metadata)` on `videos
    [B, 3, F, H, W]` (at most `max_frames` evenly spaced frames); per-sample metadata repeats for each frame.

    `score[b] = mean_f reward(videos[b, :, f], prompts[b])`; a NaN frame score makes the video's score NaN (the
    trainer drops it). Every image `Reward` scores videos this way by itself.
    """
    if videos.ndim != 5 or videos.shape[1] != 3:
        raise ValueError(f"reward {name!r} needs videos [B, 3, F, H, W] in [0, 1]; got {tuple(videos.shape)}")
    prompts = list(prompts)
    b = videos.shape[0]
    if len(prompts) != b:
        raise ValueError(f"reward {name!r} got {b} videos but {len(prompts)} prompts")
    index = frame_indices(videos.shape[2], max_frames).to(videos.device)
    f = len(index)
    frames = videos.index_select(2, index).transpose(1, 2).flatten(0, 1)  # [B * F, 3, H, W], sample-major
    texts = [p for p in prompts for _ in range(f)]
    meta = {k: _repeat(v, b, f) for k, v in metadata.items()}
    return check_output(name, reward(frames, texts, **meta), b * f).view(b, f).mean(1)


def _repeat(value, b: int, f: int):
    """Per-sample metadata (a list or tensor of length `b`) repeated `f` times each; anything else as is."""
    if isinstance(value, torch.Tensor) and value.ndim and len(value) == b:
        return value.repeat_interleave(f, dim=0)
    if isinstance(value, (list, tuple)) and len(value) == b:
        return [v for v in value for _ in range(f)]
    return value


@register("per_frame")
class PerFrame:
    """Any image reward callable on every frame of a video, averaged over the frames (needs: what that reward needs).

    Image `Reward`s (every built-in) score videos frame by frame by themselves; `per_frame` does it for any callable
    (your own function, `package.module:attribute`) and can score a subset of frames: `{name: per_frame, kwargs:
    {reward: my_pkg.rewards:sharpness, max_frames: 4}}` (the reward's own arguments beside `reward`).

    Args:
        reward (`str`): the image reward (a registered name or `package.module:attribute`).
        max_frames (`int`, *optional*): score at most this many evenly spaced frames (first and last included), to
            bound the cost on long videos. Default: every frame.
        **kwargs: the image reward's arguments.
    """

    def __init__(self, reward: str, max_frames: int | None = None, **kwargs):
        from flowrl import rewards

        if reward == "per_frame":
            raise ValueError("per_frame wraps an image reward, not itself")
        self.reward_name, self.max_frames = reward, max_frames
        self.reward = rewards.get(reward, **kwargs)
        if hasattr(self.reward, "check_prompts"):
            self.check_prompts = self.reward.check_prompts

    def __call__(self, videos: torch.Tensor, prompts, **metadata) -> torch.Tensor:
        """`[B]` for `videos [B, 3, F, H, W]` (images `[B, 3, H, W]` are one-frame videos)."""
        videos = videos.unsqueeze(2) if videos.ndim == 4 else videos
        return score_frames(
            self.reward, videos, prompts, max_frames=self.max_frames, name=f"per_frame({self.reward_name})", **metadata
        )


@register("temporal_consistency")
class TemporalConsistency(Reward):
    """Mean similarity of consecutive frames, `1 - mean|x_{f+1} - x_f|`: 1 for a still video (needs: nothing).

    `score[b] = 1 - mean_{f < F-1} mean_{c,h,w} |video[b, c, f+1] - video[b, c, f]|`, in [0, 1] for pixels in [0, 1]
    (a one-frame video scores 1). It rewards smooth motion and penalises flicker; alone it also rewards stillness,
    so it is a regulariser beside a content reward (a small weight), not a goal.
    """

    video = True

    def __init__(self, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 64):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        videos = images.float()  # [B, 3, F, H, W]
        if videos.shape[2] < 2:
            return torch.ones(videos.shape[0])
        change = (videos[:, :, 1:] - videos[:, :, :-1]).abs().mean(dim=(1, 3, 4))  # [B, F - 1]
        return 1.0 - change.mean(1)
