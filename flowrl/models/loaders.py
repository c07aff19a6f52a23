"""Load SD3/3.5, Flux.1 and SD1.x/2.x pipelines from a hub id or a local folder.

Weights are never fetched behind the user's back: a local path that does not exist is an error that names
it, and a hub id that cannot be resolved (offline machine, missing login for gated models) is an error that
says how to provide the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def families() -> dict[str, str]:
    """flowrl family -> diffusers pipeline class name, for every registered adapter (`MODEL_FAMILIES`)."""
    from flowrl.models.families import MODEL_FAMILIES

    return {name: MODEL_FAMILIES.get(name).pipeline_class for name in MODEL_FAMILIES}


def _family_of(pipeline_class: str) -> str | None:
    return {cls: name for name, cls in families().items()}.get(pipeline_class)


TINY_PREFIX = "tiny:"
"""`model.name: tiny:<family>` (or `tiny:<family>@<seed>`): the family's tiny random pipeline, built offline once into
the cache and loaded from there like any folder (configs/<family>/tiny.yaml; runs with no hub and no weights)."""


def tiny_folder(name: str) -> Path:
    """The cached folder of the tiny pipeline `tiny:<family>[@<seed>]`, built (once, under a lock) if missing."""
    from flowrl.cache import build_once, cache_root, write_atomic
    from flowrl.models.families import MODEL_FAMILIES

    spec = name[len(TINY_PREFIX) :]
    family, _, seed = spec.partition("@")
    cls = MODEL_FAMILIES.get(family)  # an unknown family fails naming the registered ones
    if seed and not seed.isdigit():
        raise ValueError(f"model.name {name!r}: the seed after '@' must be a non-negative integer")
    seed = int(seed or 0)
    target = cache_root() / "tiny" / f"{family}-seed{seed}"

    def build(folder: Path) -> None:
        def write(tmp: Path) -> None:
            cls.tiny(seed=seed).save_pretrained(tmp)
            (tmp / "meta.json").write_text(json.dumps({"family": family, "seed": seed}))

        write_atomic(folder, write)

    return build_once(target, False, build)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") != 1


def detect_family(path: str | Path) -> str:
    """The family of a local pipeline folder, from its `model_index.json`."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{path} is not a diffusers pipeline folder: no model_index.json in it")
    name = json.loads(index.read_text()).get("_class_name", "")
    family = _family_of(name)
    if family is None:
        raise ValueError(
            f"{index} describes a {name or 'unknown'} pipeline; flowrl supports {', '.join(families().values())}"
        )
    return family


def load_pipeline(
    name_or_path: str | Path,
    *,
    family: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **kwargs,
):
    """A diffusers pipeline (components in eval mode) from a hub id or a local folder.

    Args:
        name_or_path: a hub id (`stabilityai/stable-diffusion-3.5-medium`, `black-forest-labs/FLUX.1-dev`,
            `stable-diffusion-v1-5/stable-diffusion-v1-5`), a folder written by `save_pretrained`, or
            `tiny:<family>[@<seed>]` (the family's tiny random pipeline, built offline into the cache).
        family (`str`, *optional*): `sd3`, `flux`, `unet` (or another registered family); detected from
            `model_index.json` when omitted.
        dtype (`torch.dtype`, defaults to fp32): the components' dtype (bf16 on GPU for the large models).
        device: where to put the components.
        **kwargs: passed to `from_pretrained` (`revision`, `variant`, ...).
    """
    import diffusers

    name = str(name_or_path)
    if name.startswith(TINY_PREFIX):
        name = str(tiny_folder(name))
    local = _looks_local(name)
    if local:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model folder {path} does not exist (pass a hub id or a save_pretrained folder)")
        family = family or detect_family(path)
        name = str(path)
    load_kwargs = dict
    if family is None:
        pipeline_cls = diffusers.DiffusionPipeline
    elif family in families():
        from flowrl.models.families import MODEL_FAMILIES

        pipeline_cls = getattr(diffusers, families()[family])
        load_kwargs = MODEL_FAMILIES.get(family).pipeline_load_kwargs
    else:
        raise ValueError(f"unknown model family {family!r}; choose from {', '.join(families())}")
    from packaging.version import Version

    # diffusers 0.42 renamed `torch_dtype` to `dtype`
    dtype_key = "dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype"
    try:
        pipe = pipeline_cls.from_pretrained(name, **{dtype_key: dtype}, **{**load_kwargs(name), **kwargs})
    except (OSError, ValueError) as err:
        if local:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        first = first if len(first) <= 160 else first[:157].rsplit(" ", 1)[0] + " ..."
        raise OSError(
            f"could not load {name!r} from the Hugging Face hub ({first}); on a machine without hub access "
            f"download it elsewhere with `hf download {name} --local-dir DIR` and pass DIR as model.name (gated "
            "models such as SD3.5 and FLUX.1-dev need `hf auth login` first)"
        ) from None
    if _family_of(type(pipe).__name__) is None:
        raise ValueError(f"{name} is a {type(pipe).__name__}; flowrl supports {', '.join(families().values())}")
    pipe.to(device)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
