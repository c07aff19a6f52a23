"""Videos as flowrl passes them around: `[B, 3, F, H, W]` in [0, 1] (images are `[B, 3, H, W]`).

`frame_strips` lays each video's frames side by side (the frame grids of `image_grid`, evaluation sheets and
TensorBoard when it cannot show videos); `write_mp4` / `read_mp4` go through imageio's ffmpeg plugin (the `video`
extra: `pip install flowrl-toolkit[video]`).
"""

from __future__ import annotations

from pathlib import Path

import torch


FPS = 16
"""Frames per second of written videos (Wan's, as in diffusers' `export_to_video(..., fps=16)` examples)."""


def is_video(x: torch.Tensor) -> bool:
    """Whether `x` is a batch of videos `[B, 3, F, H, W]` (not images `[B, 3, H, W]`)."""
    return x.ndim == 5


def frame_strips(videos: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """`[N, 3, H, k (W + g) - g]`: at most `max_frames` evenly spaced frames (first and last included) of each video
    `[N, 3, F, H, W]` side by side, `g = max(1, W // 32)` white columns apart; images `[N, 3, H, W]` pass through."""
    if not is_video(videos):
        return videos
    f, w = videos.shape[2], videos.shape[-1]
    index = torch.linspace(0, f - 1, min(f, max_frames)).round().long().to(videos.device)
    gap = max(1, w // 32)
    frames = torch.nn.functional.pad(videos.index_select(2, index), (0, gap), value=1.0)  # [N, 3, k, H, W + g]
    return frames.permute(0, 1, 3, 2, 4).flatten(3)[..., :-gap]  # [N, 3, H, k (W + g) - g]


def contact_sheet(video: torch.Tensor) -> torch.Tensor:
    """`[3, H, 3 W + 2 g]`: the first, middle and last frames of one video `[3, F, H, W]` side by side (`frame_strips`
    with three frames; fewer for a shorter video)."""
    return frame_strips(video[None], max_frames=3)[0]


def _uint8_frames(video: torch.Tensor):
    """`[3, F, H, W]` in [0, 1] as a numpy `[F, H, W, 3]` uint8 array."""
    pixels = (video.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(1, 2, 3, 0).cpu().numpy()


def write_mp4(video: torch.Tensor, path: str | Path, fps: int = FPS) -> Path:
    """Write one video `[3, F, H, W]` in [0, 1] as an H.264 `.mp4` (imageio + imageio-ffmpeg); returns the path."""
    try:
        import imageio.v2 as imageio
        import imageio_ffmpeg  # noqa: F401  (the ffmpeg binary imageio writes through)
    except ImportError as err:
        raise ImportError(
            "writing .mp4 needs imageio and imageio-ffmpeg: pip install 'flowrl-toolkit[video]'"
        ) from err
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"write_mp4 needs one video [3, F, H, W]; got {tuple(video.shape)}")
    path = Path(path)
    imageio.mimwrite(
        path,
        list(_uint8_frames(video)),
        fps=fps,
        codec="libx264",
        quality=8,
        macro_block_size=1,
        ffmpeg_log_level="error",
    )
    return path


def read_mp4(path: str | Path) -> torch.Tensor:
    """A video file as `[3, F, H, W]` floats in [0, 1] (imageio + imageio-ffmpeg)."""
    import imageio.v2 as imageio
    import numpy as np

    frames = np.stack(imageio.mimread(path, memtest=False))  # [F, H, W, 3]
    return torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 255


def tensorboard_videos() -> bool:
    """Whether TensorBoard's `add_video` can encode (it needs moviepy < 2, whose `moviepy.editor` it imports)."""
    try:
        import moviepy.editor  # noqa: F401
    except Exception:  # noqa: BLE001  (missing, or moviepy 2 without `editor`)
        return False
    return True
