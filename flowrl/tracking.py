"""Run logging: `metrics.jsonl` (always), accelerate trackers (TensorBoard by default), image grids, PNG curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


class PeakMemory:
    """Memory of each phase of an epoch, as `memory/<phase>_gb` metrics: on a GPU the peak allocated since the
    previous mark (CUDA's peak counter, reset at every mark); on CPUs the process's resident set at the mark
    (Linux `/proc/self/statm`; NaN elsewhere), which shows what a phase left allocated.

    Args:
        device (`torch.device`): the run's device.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()

    def start(self) -> None:
        """Begin the first phase."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, phase: str) -> dict[str, float]:
        """End `phase` (and begin the next): `{"memory/<phase>_gb": GiB}`."""
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the phase's kernels done: its time and peak are its own
            used = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            used = resident_bytes()
        return {f"memory/{phase}_gb": used / 2**30}


def resident_bytes() -> float:
    """This process's resident memory in bytes (NaN where `/proc` is missing)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return float("nan")


def scalar(value):
    """A JSON-friendly number from tensors / numbers: integers stay integers (`epoch`), the rest floats."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float()
        return float(value) if value.numel() == 1 else [float(v) for v in value.flatten()]
    if isinstance(value, bool) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return float(value) if isinstance(value, float) else value


class MetricsLog:
    """Appends one JSON object per epoch to `metrics.jsonl` and keeps the history in memory."""

    def __init__(self, path: str | Path, history: list[dict] | None = None):
        self.path = Path(path)
        self.history = list(history or [])

    def append(self, record: dict) -> None:
        record = {k: scalar(v) for k, v in record.items()}
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")

    def rewrite(self) -> None:
        """Rewrite the file from the in-memory history (after a resume truncates it)."""
        self.path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in self.history))


def image_grid(images: torch.Tensor, captions: list[str], path: str | Path, columns: int = 8, title: str = ""):
    """Save a PNG grid of `images [N, 3, H, W]` in [0, 1] with a caption under each; returns the path.

    Captions are wrapped (not cut) to the image's width, and each row is as tall as its longest caption, so a
    caption never hides under the next row. Videos `[N, 3, F, H, W]` show as frame strips (`flowrl.video`).
    """
    import textwrap

    import matplotlib

    from flowrl.video import frame_strips, is_video

    cell_w = cell_h = 2.0  # inches per image
    if is_video(images):  # a strip of frames side by side, 1.25 in tall, as many strips per row as fit in 16 in
        images = frame_strips(images)
        cell_h = 1.25
        cell_w = cell_h * images.shape[-1] / images.shape[-2]
        columns = max(1, min(columns, int(16 // cell_w)))

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(images)
    columns = min(columns, n)
    rows = math.ceil(n / columns)
    width = int(13 * cell_w)  # caption characters per line
    wrapped = ["\n".join(textwrap.wrap(c.replace("\n", " | "), width=width)) or " " for c in captions]
    lines = max(w.count("\n") + 1 for w in wrapped)
    caption_h = 0.13 * lines  # inches of caption text under each image
    fig, axes = plt.subplots(
        rows, columns, figsize=(cell_w * columns, (cell_h + caption_h) * rows + (0.4 if title else 0)), squeeze=False
    )
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, caption in zip(axes.flat, images, wrapped):
        ax.imshow(image.detach().float().permute(1, 2, 0).clamp(0, 1).cpu().numpy(), interpolation="nearest")
        ax.text(0.5, -0.03, caption, transform=ax.transAxes, ha="center", va="top", fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(h_pad=caption_h * 72 / 6)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # the last row's captions lie below its axes
    plt.close(fig)
    return path


def add_samples(writer, tag: str, images: torch.Tensor, step: int) -> None:
    """Samples to a TensorBoard `writer`: images `[N, 3, H, W]` (small ones upscaled); videos `[N, 3, F, H, W]` as
    videos where TensorBoard can encode them (moviepy < 2 installed), else as frame strips."""
    from flowrl.video import FPS, frame_strips, is_video, tensorboard_videos

    images = images.detach().float().clamp(0, 1).cpu()
    if is_video(images) and tensorboard_videos():
        writer.add_video(tag, images.transpose(1, 2), step, fps=FPS)  # add_video takes [N, F, 3, H, W]
        return
    writer.add_images(tag, upscale(frame_strips(images)), step)


def upscale(images: torch.Tensor, min_size: int = 128) -> torch.Tensor:
    """Nearest-neighbour upscale of `[N, C, H, W]` images so that the shorter side is at least `min_size`."""
    factor = math.ceil(min_size / min(images.shape[-2:]))
    if factor <= 1:
        return images
    return torch.nn.functional.interpolate(images.float(), scale_factor=factor, mode="nearest")


def plot_curves(history: list[dict], out_dir: str | Path) -> list[Path]:
    """PNG plots of the training reward, the evaluation metrics and the trust-region diagnostics.

    One pyplot-free figure on fixed margins, cleared for each plot: `tight_layout` draws a figure once more to measure
    it, which with pyplot's figure creation was most of a short run's last second."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = _keys(history)
    groups = {
        "reward": [k for k in keys if k.startswith("reward/")],
        "eval": [k for k in keys if k.startswith("eval/")],
        "trust_region": [k for k in ("clipfrac", "clipfrac_high", "clipfrac_low", "approx_kl") if k in keys],
        "loss": [k for k in ("loss", "kl") if k in keys],
    }
    fig = Figure(figsize=(6, 3.5))
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.96)  # room for 7-character tick labels
    ax = fig.add_subplot()
    paths = []
    for name, group in groups.items():
        if not group:
            continue
        ax.clear()
        for key in group:
            points = [(r["epoch"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 40 else None, label=key)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def _keys(history):
    keys = []
    for record in history:
        keys.extend(k for k in record if k not in keys)
    return keys


def flat_config(config: dict) -> dict:
    """A nested config dict as `{"a.b": value}` with plain values (what trackers take as hyper-parameters)."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, str, bool)):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    walk("", config)
    return out


def summary_screen(summary: dict, output_dir) -> str:
    """The table printed at the end of a run: every evaluation metric at start and end, and what its folder holds."""
    lines = [
        f"\n== {summary['trainer']}: {summary['epochs']} epochs in {summary['wall_s']:.0f} s ==",
        f"{'metric':<28}{'start':>10}{'end':>10}",
    ]
    for key, start in summary["eval_start"].items():
        end = summary["eval_end"].get(key)
        fmt = lambda v: f"{v:10.4f}" if isinstance(v, float) else f"{v!s:>10}"  # noqa: E731
        lines.append(f"{key:<28}{fmt(start)}{fmt(end)}")
    names = ["summary.json", "metrics.jsonl", "plots/", "images/", "checkpoints/"]
    kept = [name for name in names if (Path(output_dir) / name).exists()]  # what the run wrote
    lines.append(f"run folder: {output_dir}  ({', '.join(kept)})")
    return "\n".join(lines)
