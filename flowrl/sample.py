"""Images from a trained run (`flowrl sample`): PNG files, a labelled grid and how to do the same in diffusers.

`sample(RUN_OR_CHECKPOINT, prompts)` rebuilds the run's trainer from its `config.yaml`, loads a checkpoint (the
latest, `best`, or a given folder), swaps in the EMA weights when the run kept them, and samples `n` images per
prompt with one seeded generator, so the same seed gives the same images. It writes

- `OUT/<prompt index>_<sample index>.png` at the model's resolution,
- `OUT/grid.png`: one row per prompt, captioned,
- `OUT/sample.json`: the run, checkpoint, epoch, sampler, seed and which file holds which prompt;

and for LoRA runs on a diffusers pipeline it exports the adapter (`flowrl export`) into `OUT/lora` and returns the
three lines that load it into a plain diffusers pipeline.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch


def resolve(target: str | Path, which: str = "latest") -> tuple[Path, Path]:
    """`(run folder, checkpoint folder)` for a run folder (its `latest` or `best` checkpoint, or `which` as a
    path) or a checkpoint folder (`RUN/checkpoints/epoch_N`)."""
    from flowrl import checkpoint

    target = Path(target)
    if (target / "trainer_state.json").is_file() and target.parent.name == "checkpoints":
        return target.parent.parent, target
    if not (target / "config.yaml").is_file():
        raise FileNotFoundError(f"{target} is neither a run folder (no config.yaml) nor a checkpoint folder "
                                "(no trainer_state.json)")  # fmt: skip
    if which == "latest":
        return target, checkpoint.latest(target)
    if which == "best":
        best = target / "checkpoints" / "best"
        if not best.is_dir():
            raise FileNotFoundError(f"{target} kept no best checkpoint (set eval.best_metric to keep one)")
        return target, best
    return target, Path(which)


def read_prompts(prompts: str | list[str]) -> list[str]:
    """Prompts from a list, a `.txt`/`.jsonl` file or a shipped set name (`digits/test`), else one literal prompt."""
    from flowrl import prompts as prompt_sets

    if isinstance(prompts, (list, tuple)):
        return [str(p) for p in prompts]
    if Path(prompts).suffix in (".txt", ".jsonl") or prompts in prompt_sets.list_sets():
        return [str(p) for p in prompt_sets.load(prompts)]  # a missing file fails naming it
    return [prompts]


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
    """
    from flowrl.export import write
    from flowrl.tracking import image_grid
    from flowrl.trainers import build_trainer, load_config
    from flowrl.trainers.image import ImageTrainer

    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    run_dir, path = resolve(target, checkpoint)
    texts = read_prompts(prompts)
    if not texts:
        raise ValueError("no prompts to sample")
    config = load_config(run_dir / "config.yaml", ["run.log_with=[]"])
    trainer = build_trainer(config, output_dir=run_dir)
    if not isinstance(trainer, ImageTrainer):
        raise ValueError(f"{config.trainer} is not an image trainer: flowrl sample draws images")
    trainer.load_checkpoint(path)
    use_ema = trainer.ema is not None if ema is None else ema
    if use_ema and trainer.ema is None:
        raise ValueError("the run kept no EMA weights (ema_decay is not set): sample without --ema")
    policy, s, e = trainer.policy, config.sampling, config.eval
    sampler = sampler or ("ode" if policy.adapter.time_kind == "flow" else "ddim")
    rows = [p for p in texts for _ in range(n)]
    generator = torch.Generator().manual_seed(seed)
    trainer.model.eval()
    with torch.no_grad(), trainer.ema.swapped() if use_ema else nullcontext(), trainer.accelerator.autocast():
        latents = None
        if trainer.evaluation_latents is not None:  # FIND: its trained noise policy draws the starting noise
            latents = trainer.evaluation_latents(rows, generator, s.height, s.width)
        rollout = policy.rollout(rows, num_steps=num_steps or e.num_steps or s.num_steps,
                                 guidance_scale=guidance_scale if guidance_scale is not None else (
                                     e.guidance_scale if e.guidance_scale is not None else s.guidance_scale),
                                 noise_level=s.noise_level if noise_level is None else noise_level, sampler=sampler,
                                 generator=generator, height=s.height, width=s.width, latents=latents)  # fmt: skip
    out = Path(out) if out else run_dir / "samples" / path.name
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, image in enumerate(rollout.images):
        name = f"{i // n:03d}_{i % n}.png"
        _save_png(image, out / name)
        files.append({"file": name, "prompt": rows[i]})
    image_grid(rollout.images, [f"{r['prompt']} #{i % n}" for i, r in enumerate(files)], out / "grid.png",
               columns=n, title=f"{run_dir.name} {path.name}{' EMA' if use_ema else ''} seed {seed}")  # fmt: skip
    record = {"run": str(run_dir), "checkpoint": str(path), "epoch": trainer.epoch, "ema": use_ema,
              "sampler": sampler, "seed": seed, "n": n, "out": str(out), "files": files}  # fmt: skip
    if policy.has_lora and policy.adapter.pipeline is not None:
        exported = write(trainer, out / "lora", ema=use_ema)
        pipeline = type(policy.adapter.pipeline).__name__
        record["diffusers"] = [
            f"pipe = {pipeline}.from_pretrained({config.model.name!r})",
            f"pipe.load_lora_weights({str(out / 'lora')!r})",
            f"image = pipe({texts[0]!r}, num_inference_steps={num_steps or e.num_steps or s.num_steps}).images[0]",
        ]
        record["lora"] = exported["written"]
    (out / "sample.json").write_text(json.dumps(record, indent=2))
    return record


def _save_png(image: torch.Tensor, path: Path) -> None:
    """`[3, H, W]` in [0, 1] as an 8-bit RGB PNG."""
    from PIL import Image

    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    Image.fromarray(array).save(path)
