"""From a trained run to what a diffusers user loads in one line (`flowrl export`).

A checkpoint is for resuming; `export` loads the run's policy at a checkpoint without a trainer
(`flowrl.run.inference.load_run`) and writes its weights in diffusers' own formats:

- LoRA runs: `pytorch_lora_weights.safetensors` (with the adapter config as metadata), for
  `pipe.load_lora_weights(DIR)`;
- full fine-tunes of a diffusers pipeline: the whole pipeline folder with the trained network, for
  `<Pipeline>.from_pretrained(DIR)`;
- full fine-tunes of the digits world (not a diffusers pipeline: its text encoder is MiniLM, its decoder maps 8x8
  pixel latents to images): a digits model folder, `DIR/transformer` (an `SD3Transformer2DModel`) and
  `DIR/meta.json`, which `flowrl.digits.DigitsWorld(DIR, load_classifiers()).policy()` turns into a policy.

With EMA weights in the run (`ema_decay`), they are exported by default (`ema=False` exports the raw weights).
`flowrl_export.json` beside the weights records the run, the checkpoint, the epoch and the load line; for a
diffusers pipeline also `diffusers`: the lines that sample the run's first test prompt with a plain pipeline as
flowrl's evaluation does (`diffusers_lines`: its size, steps, guidance, negative prompt and seed; the source or
start image of an editing or image-to-video model), which run as written.
"""

from __future__ import annotations

import json
from pathlib import Path


def export(
    run_dir: str | Path, out: str | Path, *, checkpoint_path: str | Path | None = None, ema: bool | None = None
) -> dict:
    """Export a run's (latest or given) checkpoint to `out`; returns what was written and how to load it."""
    from flowrl.run.run_folder import writable
    from flowrl.trainers import load_run

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    writable(Path(out))
    run = load_run(run_dir, str(checkpoint_path) if checkpoint_path else "latest", ema=ema)
    record = write(run, out)
    record.update(run=str(run_dir), checkpoint=str(run.checkpoint))
    (Path(out) / "flowrl_export.json").write_text(json.dumps(record, indent=2))
    return record


def diffusers_lines(
    policy,
    base: str,
    *,
    weights: str | Path | None,
    prompt: str,
    sources=None,
    steps: int,
    guidance: float,
    height: int,
    width: int,
    seed: int,
    sampler: str | None = None,
    eta: float = 0.0,
) -> list[str]:
    """Python lines that sample `prompt` with a plain diffusers pipeline of the policy's family as flowrl samples it
    with its `ode` or `ddim` sampler (at noise `eta`) from noise seeded `seed`: the pipeline loaded from `base` (with
    the components the family loads itself), the LoRA in `weights` (None: `base` holds the trained weights), the
    family's scheduler, guidance, negative prompt and size arguments, `sources` (paths of the editing sources or
    the start frame) as `image=`. They run as written (`tests/test_export.py` executes them for every family); none
    for a family whose pipeline needs a source image when there is none (a run trained on text prompts only)."""
    import inspect

    import diffusers

    from flowrl.models.adapter import ModelAdapter

    adapter = policy.adapter
    cls, pipeline = type(adapter), type(adapter).pipeline_class
    if cls.pipeline_needs_sources and not sources:  # its pipeline refuses a call without a source image
        return []
    family = f"MODEL_FAMILIES.get({cls.family!r})"
    own = lambda name: getattr(cls, name).__func__ is not getattr(ModelAdapter, name).__func__  # noqa: E731
    lines = ["import torch", f"from diffusers import {pipeline}"]
    if sources:
        lines.append("from diffusers.utils import load_image")
    if own("pipeline_load_kwargs") or own("set_pipeline_guidance") or own("set_pipeline_size"):
        lines.append("from flowrl.models.families import MODEL_FAMILIES")
    components = f", **{family}.pipeline_load_kwargs({base!r})" if own("pipeline_load_kwargs") else ""
    lines.append(f"pipe = {pipeline}.from_pretrained({base!r}{components})")
    scheduler, given = adapter.scheduler, adapter.pipeline.scheduler
    changed = {k: v for k, v in scheduler.config.items() if not k.startswith("_") and given.config.get(k) != v}
    if type(scheduler) is not type(given) or changed:  # the family samples with its own (SD, SDXL: DDIM)
        name = type(scheduler).__name__
        lines[1] += f", {name}"
        fixes = "".join(f", {k}={v!r}" for k, v in changed.items())
        lines.append(f"pipe.scheduler = {name}.from_config(pipe.scheduler.config{fixes})")
    if weights is not None:
        lines.append(adapter.lora_load_line(weights, lora_kwargs(adapter)))
    if own("set_pipeline_guidance"):
        lines.append(f"{family}.set_pipeline_guidance(pipe, {guidance!r})")
    if own("set_pipeline_size"):
        lines.append(f"{family}.set_pipeline_size(pipe, {height!r}, {width!r})")
    parameters = inspect.signature(getattr(diffusers, pipeline).__call__).parameters
    arguments = {}
    if sources:
        images = [f"load_image({str(path)!r})" for path in sources]
        arguments["image"] = images[0] if len(images) == 1 else f"[{', '.join(images)}]"
    arguments["prompt"] = repr(prompt)
    if "height" in parameters:  # (HunyuanVideo 1.5 image-to-video: the size of the start image's bucket)
        arguments.update(height=repr(height), width=repr(width))
    arguments["num_inference_steps"] = repr(steps)
    if cls.time_kind == "ddim" and eta:  # DDIM's noise (flowrl's `ddim` sampler at the run's noise level)
        arguments["eta"] = repr(float(eta))
    for name in _SHARED_OPTIONS:  # the family's options that are the pipeline's arguments too (None: its default)
        value = getattr(adapter.options, name, None)
        if name in parameters and value is not None:
            arguments[name] = repr(value)
    extra = {
        **cls.pipeline_call_kwargs(guidance, 1, policy.negative_prompt),
        **cls.pipeline_size_kwargs(height, width),
        **(adapter.pipeline_source_kwargs() if sources else {}),
    }
    arguments.update({k: repr(v) for k, v in extra.items()})
    arguments["generator"] = f"torch.Generator().manual_seed({seed})"
    call = ", ".join(f"{k}={v}" for k, v in arguments.items())
    lines.append(f"video = pipe({call}).frames[0]" if cls.video else f"image = pipe({call}).{cls.pipeline_output}[0]")
    resized = getattr(adapter.options, "condition_size", None)
    if sources and resized:  # FLUX.1 Kontext's `condition_size`: no pipeline argument does it
        lines.append(f"# flowrl resized the source image to {resized[0]} x {resized[1]} (condition_size) first")
    if sampler not in (None, "ode", "ddim"):
        lines.append(f"# flowrl sampled with {sampler}; the pipeline samples with its scheduler's deterministic steps")
    return ruff_layout(lines)


LINE_LENGTH = 119
"""The project's line length (`pyproject.toml`, `[tool.ruff]`), which `ruff_layout` lays the snippets out to."""


def ruff_layout(lines: list[str]) -> list[str]:
    """Single-line statements (and comments) laid out as `ruff format` lays them out, so that they stay as printed
    in a file it formats (`docs/training.md` holds one): one statement a line (`a; b` split), strings in double
    quotes, a blank line after the imports, and a call longer than `LINE_LENGTH` split one argument a line, with the
    trailing comma that keeps it split (an argument still too long is split the same way)."""
    import ast

    out, imports = [], True
    for line in lines:
        statements = [line] if line.startswith("#") else [_double_quoted(s) for s in _statements(line)]
        for text in statements:
            node = None if text.startswith("#") else ast.parse(text).body[0]
            if imports and not isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [""] if out else []
                imports = False
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                out.extend(_split(_segment(text, node.targets[0]) + " = ", node.value, text, "", ""))
            elif isinstance(node, ast.Expr):
                out.extend(_split("", node.value, text, "", ""))
            else:
                out.append(text)
    return out


def indented(lines: list[str]) -> str:
    """Snippet lines as `flowrl` prints them: indented by four spaces, blank lines left blank."""
    return "\n".join(f"    {line}" if line else "" for line in lines)


def _statements(line: str) -> list[str]:
    """The statements of one line (`a; b`: two)."""
    import ast

    return [_segment(line, node) for node in ast.parse(line).body]


def _segment(text: str, node) -> str:
    """The source of `node` in the one-line `text` (`ast`'s column offsets count UTF-8 bytes)."""
    return text.encode()[node.col_offset : node.end_col_offset].decode()


def _double_quoted(text: str) -> str:
    """A one-line statement with its string literals written as ruff writes them: in double quotes unless the
    string holds one (then in the quotes `repr` chose)."""
    import ast

    data, pieces, at = text.encode(), [], 0
    strings = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    for node in sorted(strings, key=lambda n: n.col_offset):
        literal = repr(node.value)
        if literal.startswith("'") and '"' not in node.value:
            literal = f'"{literal[1:-1]}"'
        pieces += [data[at : node.col_offset].decode(), literal]
        at = node.end_col_offset
    return "".join(pieces) + data[at:].decode()


def _split(prefix: str, node, text: str, suffix: str, indent: str) -> list[str]:
    """`indent + prefix + <node> + suffix`, its outermost call (`f(...)`, `f(...).images[0]`) split one argument a
    line when it is longer than `LINE_LENGTH`."""
    import ast

    whole = indent + prefix + _segment(text, node) + suffix
    call = node
    while isinstance(call, (ast.Attribute, ast.Subscript)):
        call = call.value
    if len(whole) <= LINE_LENGTH or not isinstance(call, ast.Call) or not (call.args or call.keywords):
        return [whole]
    data = text.encode()
    lines = [indent + prefix + data[node.col_offset : call.func.end_col_offset].decode() + "("]
    for argument in sorted([*call.args, *call.keywords], key=lambda n: n.col_offset):
        if isinstance(argument, ast.keyword):
            name = "**" if argument.arg is None else f"{argument.arg}="
            lines += _split(name, argument.value, text, ",", indent + "    ")
        else:
            lines += _split("", argument, text, ",", indent + "    ")
    return [*lines, indent + ")" + data[call.end_col_offset : node.end_col_offset].decode() + suffix]


_SHARED_OPTIONS = ("max_sequence_length", "num_frames")
"""`model.options` fields that mean what the pipeline's `__call__` arguments of the same name mean (SANA's
`complex_human_instruction`, a flag in flowrl, is the instruction's text in the pipeline: not one of them)."""


def lora_kwargs(adapter) -> str:
    """The extra `load_lora_weights` arguments the adapter's LoRA needs (Wan 2.2's low-noise expert:
    `load_into_transformer_2=True`), as source text."""
    return "".join(f", {k}={v!r}" for k, v in getattr(adapter, "lora_load_kwargs", {}).items())


def base_location(name: str) -> str:
    """Where diffusers loads the base model `name` from (a `tiny:` model: its cached folder)."""
    from flowrl.models.loaders import TINY_PREFIX, tiny_folder

    return str(tiny_folder(name)) if name.startswith(TINY_PREFIX) else name


def source_files(sources, folder: Path) -> list[tuple[str, ...]] | None:
    """Each prompt's conditioning images as file paths: paths as they are, in-memory images (an editing prompt
    set's own) written once to `folder/<key>.png`; None for text-to-image."""
    import hashlib

    from flowrl.policies.sources import source_key

    if sources is None:
        return None
    files = []
    for entry in sources:
        paths = []
        for image in entry:
            if isinstance(image, (str, Path)):
                paths.append(str(image))
                continue
            path = folder / f"{hashlib.sha1(source_key(image).encode()).hexdigest()[:12]}.png"
            if not path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                _save_image(image, path)
            paths.append(str(path))
        files.append(tuple(paths))
    return files


def _save_image(image, path: Path) -> None:
    """A PIL image, or a `[3, H, W]` tensor in [0, 1], as an 8-bit RGB PNG."""
    import torch

    if isinstance(image, torch.Tensor):
        from PIL import Image

        array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        image = Image.fromarray(array)
    image.convert("RGB").save(path)


def write(run, out: str | Path) -> dict:
    """Write a loaded run's policy weights (as loaded: EMA or raw) to `out` in diffusers' format; returns a record."""
    out = Path(out)
    policy = run.policy
    if run.algorithm.trained_module() is not getattr(policy, "model", None):
        raise ValueError(
            f"{run.config.trainer} trains {type(run.algorithm.trained_module()).__name__}, not the "
            "diffusion model: there is no diffusers artefact to export (its weights are in the "
            "run's checkpoints)"
        )
    if not hasattr(policy, "adapter"):
        raise ValueError(f"{run.config.trainer} trains no diffusion model: flowrl export writes diffusers weights")
    out.mkdir(parents=True, exist_ok=True)
    if policy.has_lora:
        written = policy.save_lora(out)
        pipeline = type(policy.adapter.pipeline).__name__
        load = f"{pipeline}.from_pretrained(BASE).load_lora_weights({str(out)!r})"
        if getattr(policy.adapter, "lora_loader", None) is not None:  # a pipeline without a LoRA loader mixin
            load = f"pipe = {pipeline}.from_pretrained(BASE); " + policy.adapter.lora_load_line(out)
    elif policy.adapter.pipeline is not None:
        policy.adapter.pipeline.save_pretrained(out)
        written = out / "model_index.json"
        load = f"{type(policy.adapter.pipeline).__name__}.from_pretrained({str(out)!r})"
    else:  # the digits world: a digits model folder (its transformer and meta.json), which `DigitsWorld` loads
        policy.model.save_pretrained(out / "transformer")
        meta = {"exported_from": str(run.run_dir), "checkpoint": str(run.checkpoint), "epoch": run.epoch}
        (out / "meta.json").write_text(json.dumps(meta, indent=2))
        written = out / "transformer" / "config.json"
        load = f"flowrl.digits.DigitsWorld({str(out)!r}, flowrl.digits.load_classifiers()).policy()"
    record = {
        "epoch": run.epoch,
        "ema": run.ema,
        "kind": "lora" if policy.has_lora else "full",
        "written": str(written),
        "load": load,
    }
    if policy.adapter.pipeline is not None:  # the run's first test prompt, sampled by a plain pipeline
        from flowrl import prompts

        config = run.config
        s, e = config.sampling, config.eval
        first = prompts.load(config.prompts.test)[:1]
        sources = source_files(prompts.source_images(first), out / "sources")
        base = base_location(config.model.name) if policy.has_lora else str(out)
        lines = diffusers_lines(
            policy,
            base,
            weights=out if policy.has_lora else None,
            prompt=str(first[0]),
            sources=sources[0] if sources else None,
            steps=e.num_steps or s.num_steps,
            guidance=s.guidance_scale if e.guidance_scale is None else e.guidance_scale,
            height=s.height,
            width=s.width,
            seed=0,
        )
        if lines:
            record["diffusers"] = lines
    (out / "flowrl_export.json").write_text(json.dumps(record, indent=2))
    return record
