"""Images from a trained run (`flowrl sample`): PNG files, a labelled grid and how to do the same in diffusers.

`sample(RUN_OR_CHECKPOINT, prompts)` loads the run's policy at a checkpoint (the latest, `best`, or a given folder)
without a trainer (`flowrl.run.inference.load_run`: no optimizer, no reward model), with the EMA weights when
the run kept them, and samples `n` images per prompt with one seeded generator, so the same seed gives the same
images. It writes

- `OUT/<prompt index>-<prompt>_<sample index>.png` at the model's resolution (e.g. `000-the-number-7_0.png`),
- `OUT/grid.png`: one row per prompt, captioned,
- for a video model (Wan), `OUT/<prompt index>-<prompt>_<sample index>.mp4` instead of the PNGs, each with a
  contact sheet beside it, `..._<sample index>.frames.png` (its first, middle and last frames side by side: a run's
  progress without a player), and the grid shows each video's frames side by side (`flowrl.video`; needs the `video`
  extra); an image-to-video model starts each prompt's videos from its `--image` (one for every prompt, or one per
  prompt in order) or from an image-to-video prompt set's own start frames (`motion_shapes/test`),
- `OUT/sample.json`: the run, checkpoint, epoch, sampler, seed and which file holds which prompt;

and for LoRA runs on a diffusers pipeline it exports the adapter (`flowrl export`) into `OUT/lora` and returns the
lines that sample the first prompt with a plain diffusers pipeline as flowrl did (`flowrl.export.diffusers_lines`:
size, steps, guidance, negative prompt, seed; an editing prompt set's in-memory source images written to
`OUT/sources/`). A folder that already holds another call's samples is never written over: the call writes to
`OUT-2` (`OUT-3`, ...) instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch


def read_prompts(prompts: str | list[str]) -> list[str]:
    """Prompts from a list, a `.txt`/`.jsonl` file or a shipped set name (`digits/test`), else one literal prompt."""
    from flowrl import prompts as prompt_sets

    if isinstance(prompts, (list, tuple)):
        return [str(p) for p in prompts]
    if Path(prompts).suffix in (".txt", ".jsonl") or prompts in prompt_sets.list_sets():
        return [str(p) for p in prompt_sets.load(prompts)]  # a missing file fails naming it
    return [prompts]


def read_sources(prompts: str | list[str], image, count: int) -> list[tuple] | None:
    """Each prompt's source images (editing): `image` (a path or a list of paths) for every prompt, else an editing
    prompt set's own (`Prompt.images`), else None (text-to-image)."""
    from flowrl import prompts as prompt_sets
    from flowrl.prompts import source_images

    if image is not None:
        images = tuple([image] if isinstance(image, (str, Path)) else image)
        missing = [str(i) for i in images if not Path(i).is_file()]
        if missing:
            raise ValueError(f"--image: no such file {', '.join(missing)}")
        return [images] * count
    if not isinstance(prompts, (list, tuple)) and (
        Path(prompts).suffix in (".txt", ".jsonl") or prompts in prompt_sets.list_sets()
    ):
        return source_images(prompt_sets.load(prompts))
    return None


def start_frames(images: tuple, count: int) -> list[tuple]:
    """Image-to-video: each of `count` prompts' start frame from `--image`: one image for every prompt, or one per
    prompt in order."""
    if len(images) not in (1, count):
        raise ValueError(
            f"--image: an image-to-video model takes one start image for every prompt or one per prompt; got "
            f"{len(images)} images for {count} prompts"
        )
    return [(images[0],)] * count if len(images) == 1 else [(i,) for i in images]


def file_name(index: int, prompt: str, sample: int) -> str:
    """`<prompt index>-<prompt as a slug, at most 40 characters>_<sample index>.png`."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40].rstrip("-") or "prompt"
    return f"{index:03d}-{slug}_{sample}.png"


def sample(
    target: str | Path,
    prompts: str | list[str],
    *,
    n: int = 4,
    seed: int = 0,
    sampler: str | None = None,
    noise_level: float | None = None,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    checkpoint: str = "latest",
    ema: bool | None = None,
    out: str | Path | None = None,
    image: str | Path | list | None = None,
) -> dict:
    """Sample `n` images per prompt from a run's checkpoint and write them to `out`; returns the record.

    Args:
        target (`str` or `Path`): a run folder or one of its checkpoint folders.
        prompts (`str` or `list[str]`): prompts, a prompt file, or one prompt.
        n (`int`, defaults to 4): images per prompt.
        seed (`int`, defaults to 0): the noise seed (the same seed gives the same images).
        sampler (`str`, *optional*): `ode` (default for flow models; `ddim` for UNets) or any training sampler.
        noise_level (`float`, *optional*): the sampler's noise (default: the run's).
        num_steps, guidance_scale (*optional*): default: the run's evaluation settings.
        checkpoint (`str`, defaults to `"latest"`): `latest`, `best` or a checkpoint folder.
        ema (`bool`, *optional*): use the EMA weights (default: when the run kept them).
        out (`str` or `Path`, *optional*): default `RUN/samples/<checkpoint name>`.
        image (`str`, `Path` or a list of them, *optional*): editing models: the source image(s) every prompt edits
            (default: an editing prompt set's own, e.g. `edit_shapes/test`; none: text-to-image); image-to-video
            models: the start frame of every prompt, or a list of one per prompt (in order).
    """
    from flowrl.export import base_location, diffusers_lines, source_files, write
    from flowrl.image import ImageModality
    from flowrl.policies.sources import source_key
    from flowrl.run.inference import resolve
    from flowrl.run.run_folder import writable
    from flowrl.tracking import image_grid
    from flowrl.trainers import TRAINERS, load_config, load_run
    from flowrl.video import contact_sheet, write_mp4

    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    texts = read_prompts(prompts)
    if not texts:
        raise ValueError("no prompts to sample")
    sources = read_sources(prompts, image, len(texts))  # before any model loads: a missing image fails at once
    run_dir, path = resolve(target, checkpoint)
    config = load_config(run_dir / "config.yaml", ["run.log_with=[]"])
    if TRAINERS.get(config.trainer).modality_class is not ImageModality:
        raise ValueError(f"{config.trainer} is not an image trainer: flowrl sample draws images")
    out = unused_folder(Path(out) if out else run_dir / "samples" / path.name)  # never over another call's files
    writable(out)  # before any model loads: a read-only folder fails at once
    run = load_run(run_dir, str(path), ema=ema)
    policy, s, e = run.policy, config.sampling, config.eval
    if image is not None and policy.adapter.conditioning == "start_frame":  # image-to-video: a start frame each
        sources = start_frames(sources[0], len(texts))
    sampler = sampler or ("ode" if policy.adapter.time_kind == "flow" else "ddim")
    rows = [p for p in texts for _ in range(n)]
    generator = torch.Generator().manual_seed(seed)
    steps = num_steps or e.num_steps or s.num_steps
    guidance = (
        guidance_scale
        if guidance_scale is not None
        else (e.guidance_scale if e.guidance_scale is not None else s.guidance_scale)
    )
    latents_of = run.algorithm.evaluation_latents
    with torch.no_grad():
        # FIND: its trained noise policy draws the starting noise
        latents = latents_of(rows, generator, s.height, s.width) if latents_of is not None else None
        edits = None if sources is None else [x for x in sources for _ in range(n)]  # editing: each row's source
        rollout = policy.rollout(
            rows,
            num_steps=steps,
            guidance_scale=guidance,
            sampler=sampler,
            noise_level=s.noise_level if noise_level is None else noise_level,
            generator=generator,
            height=s.height,
            width=s.width,
            latents=latents,
            source_images=edits,
        )
    files = []
    for i, image in enumerate(rollout.images):
        name = file_name(i // n, rows[i], i % n)
        sheet = {}
        if image.ndim == 4:  # a video [3, F, H, W]: an .mp4 and its contact sheet (grid.png shows its frames)
            name = name.removesuffix(".png") + ".mp4"
            write_mp4(image, out / name)
            sheet = {"frames": name.removesuffix(".mp4") + ".frames.png"}
            _save_png(contact_sheet(image), out / sheet["frames"])
        else:
            _save_png(image, out / name)
        files.append({"file": name, "prompt": rows[i], **sheet})
    image_grid(
        rollout.images,
        [f"{r['prompt']} #{i % n}" for i, r in enumerate(files)],
        out / "grid.png",
        columns=n,
        title=f"{run_dir.name} {path.name}{' EMA' if run.ema else ''} seed {seed}",
    )
    record = {
        "run": str(run_dir),
        "checkpoint": str(path),
        "epoch": run.epoch,
        "ema": run.ema,
        "sampler": sampler,
        "seed": seed,
        "n": n,
        "out": str(out),
        "files": files,
    }
    if sources is not None:  # editing: which source image(s) each prompt edited (in-memory ones by their key)
        record["images"] = [
            [str(x) if isinstance(x, (str, Path)) else source_key(x) for x in entry] for entry in sources
        ]
    if policy.has_lora and policy.adapter.pipeline is not None:
        exported = write(run, out / "lora")
        files = source_files(sources[:1], out / "sources") if sources is not None else None  # editing: as files
        lines = diffusers_lines(
            policy,
            base_location(config.model.name),
            weights=out / "lora",
            prompt=texts[0],
            sources=files[0] if files else None,
            steps=steps,
            guidance=guidance,
            height=s.height,
            width=s.width,
            seed=seed,
            sampler=sampler,
            eta=s.noise_level if noise_level is None else noise_level,
        )
        if lines:
            record["diffusers"] = lines
        record["lora"] = exported["written"]
    (out / "sample.json").write_text(json.dumps(record, indent=2))
    return record


def unused_folder(out: Path) -> Path:
    """`out`, or when it already holds another call's samples (its `sample.json` or `grid.png`), the first of
    `out-2`, `out-3`, ... that does not: two calls into one folder keep both sets."""
    candidate, number, named = out, 1, out if out.name else out.absolute()  # (`.`: the folder's own name)
    while (candidate / "sample.json").exists() or (candidate / "grid.png").exists():
        number += 1
        candidate = named.with_name(f"{named.name}-{number}")
    return candidate


def _save_png(image: torch.Tensor, path: Path) -> None:
    """`[3, H, W]` in [0, 1] as an 8-bit RGB PNG."""
    from PIL import Image

    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    Image.fromarray(array).save(path)
