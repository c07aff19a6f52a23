"""Published architecture configs of every family's real checkpoints, and real-size pipelines built from them without
weights.

`flowrl/models/published/<owner>--<name>.json` holds, per checkpoint, the diffusers pipeline class (as its
`model_index.json` names it) and, for each component with weights plus the scheduler, its class, library, the values
of its `config.json` and where each was read (`sources`); values no source confirmed are listed in `unverified`.
`build_pipeline` turns one into the family's diffusers pipeline whose networks are real-size modules that own no
memory: built on the `meta` device, or as fake CPU tensors inside a caller's `FakeTensorMode` (what `flowrl plan`
traces). Tokenizers and processors come from the family's tiny pipeline (built in code, no hub).

    pipe = build_pipeline("stabilityai/stable-diffusion-3.5-medium")      # meta, bf16
    parameter_counts("black-forest-labs/FLUX.1-dev")["transformer"]       # 11.9e9 (docs/models.md's table)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from flowrl.models.meta_init import no_init_without_data


DATA = Path(__file__).with_name("published")
"""The package-data folder of published configs (one JSON file per checkpoint)."""
TRAINED = ("transformer", "transformer_2", "unet")
"""Component names of the trained networks (Wan 2.2 A14B: both experts)."""
_NOT_MODULES = ("scheduler", "guider")


@dataclasses.dataclass(frozen=True)
class PublishedComponent:
    """One component of a published pipeline."""

    name: str
    """Its slot in the pipeline (`transformer`, `text_encoder_2`, `vae`, `scheduler`, ...)."""
    cls: str
    """The class `model_index.json` names (`SD3Transformer2DModel`, `T5EncoderModel`, ...)."""
    library: str
    """`diffusers`, `transformers` or a module of theirs (`diffusers.pipelines.ltx2`: classes the top level omits)."""
    config: Mapping
    """The values of its `config.json` (or `scheduler_config.json`) that define it."""
    sources: tuple[str, ...] = ()
    """Where the values were read (repository and path, or the documented defaults used)."""

    def resolve(self):
        """The class object from its library (an unknown class fails naming the component)."""
        library = _library(self.library)
        if library is None:
            raise ValueError(
                f"component {self.name!r}: library {self.library!r} is not diffusers, transformers or one of their "
                "modules (diffusers.pipelines.ltx2)"
            )
        found = getattr(library, self.cls, None)
        if found is None:
            raise ValueError(f"component {self.name!r}: {self.library} has no class {self.cls!r}")
        return found


def _library(name: str):
    """The module a component's class lives in: `diffusers`, `transformers`, a module of theirs (LTX-2's connectors
    and vocoder: `diffusers.pipelines.ltx2`), or a pipeline-local name as `model_index.json` writes it (`ltx2`: a
    module of `diffusers.pipelines`); None for anything else."""
    import importlib

    if name.split(".")[0] not in ("diffusers", "transformers"):
        name = f"diffusers.pipelines.{name}"
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@dataclasses.dataclass(frozen=True)
class PublishedCheckpoint:
    """A published checkpoint's architecture: pipeline class, components and what stays unconfirmed."""

    name: str
    """The hub id (`stabilityai/stable-diffusion-3.5-medium`)."""
    family: str
    """The flowrl model family (`sd3`)."""
    pipeline: str
    """The diffusers pipeline class name (`StableDiffusion3Pipeline`)."""
    components: Mapping[str, PublishedComponent]
    """Components with weights, the scheduler (and HunyuanVideo 1.5's guider), by pipeline slot."""
    pipeline_config: Mapping = dataclasses.field(default_factory=dict)
    """Non-component `model_index.json` entries the pipeline takes (`boundary_ratio`, `is_distilled`, ...)."""
    unverified: tuple[str, ...] = ()
    """Values no source confirmed (best values stored), as `component.key` or a sentence."""
    not_built: tuple[str, ...] = ()
    """`model_index.json` slots left empty (SD1.5's safety checker and its feature extractor)."""
    also: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Other families whose pipeline loads the same folder, family -> pipeline class (an image-to-video pipeline over
    a text-to-video checkpoint: LTX-2's `ltx2_i2v`, Wan2.2-TI2V-5B's `wan_i2v`)."""

    def serves(self, family: str) -> bool:
        """Whether the checkpoint loads as `family` (its own, or one of `also`)."""
        return family == self.family or family in self.also

    def pipeline_of(self, family: str) -> str:
        """The diffusers pipeline class the checkpoint loads as for `family`."""
        return self.pipeline if family == self.family else self.also[family]

    @property
    def trained(self) -> tuple[str, ...]:
        """The component names of the trained network(s)."""
        return tuple(name for name in TRAINED if name in self.components)


def _load(path: Path) -> PublishedCheckpoint:
    raw = json.loads(path.read_text())
    components = {
        slot: PublishedComponent(slot, c["class"], c["library"], MappingProxyType(c["config"]), tuple(c["sources"]))
        for slot, c in raw["components"].items()
    }
    return PublishedCheckpoint(
        name=raw["name"],
        family=raw["family"],
        pipeline=raw["pipeline"],
        components=MappingProxyType(components),
        pipeline_config=MappingProxyType(raw.get("pipeline_config", {})),
        unverified=tuple(raw.get("unverified", ())),
        not_built=tuple(raw.get("not_built", ())),
        also=MappingProxyType(raw.get("also", {})),
    )


@functools.cache
def _all() -> dict[str, PublishedCheckpoint]:
    checkpoints = [_load(path) for path in sorted(DATA.glob("*.json"))]
    return {c.name: c for c in checkpoints}


def published_checkpoints(family: str | None = None) -> list[str]:
    """The hub ids with a published config, of one family (`sd3`, ...: its own checkpoints and those that load as it
    too, `PublishedCheckpoint.also`) or of all; sorted."""
    return sorted(name for name, c in _all().items() if family is None or c.serves(family))


def published(name: str) -> PublishedCheckpoint:
    """The published config of hub id `name` (an unknown one fails naming the known ones)."""
    found = _all().get(name)
    if found is None:
        raise ValueError(f"no published config for {name!r}; known: {', '.join(published_checkpoints())}")
    return found


def _fake_mode():
    """The `FakeTensorMode` the caller entered, or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, FakeTensorMode)), None)


@functools.cache
def _tiny(family: str):
    """The family's tiny pipeline (its tokenizers and processors), built once, with real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from flowrl.models.families import MODEL_FAMILIES

    with unset_fake_temporarily(), torch.device("cpu"):
        return MODEL_FAMILIES.get(family).tiny(seed=0)


def _build_module(component: PublishedComponent, dtype: torch.dtype, device, fake):
    """A real-size module from `component.config`: parameters on `device` (meta: no memory) or fake under `fake`."""
    cls = component.resolve()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), no_init_without_data():
            if component.library.startswith("diffusers"):
                module = cls.from_config(dict(component.config))
            else:
                module = cls._from_config(cls.config_class(**component.config), dtype=dtype)
    finally:
        torch.set_default_dtype(default)
    _settle(module, None if component.library.startswith("transformers") else dtype, fake)
    return module.eval()


def _settle(module: torch.nn.Module, dtype: torch.dtype | None, fake) -> None:
    """Cast a diffusers model's floating tensors to `dtype` as its `from_pretrained(dtype=...)` does (its
    `_keep_in_fp32_modules` stay fp32; buffers computed in fp32, such as SD3's positional table, follow the weights);
    under `fake`, make any tensor created outside the fake mode (e.g. from numpy) fake too."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for qualified, sub in module.named_modules():
        for key, tensor in list(sub._parameters.items()) + list(sub._buffers.items()):
            if tensor is None:
                continue
            new = tensor
            if dtype is not None and tensor.is_floating_point():
                new = new.to(torch.float32 if keep & set(f"{qualified}.{key}".split(".")) else dtype)
            if fake is not None and not fake.is_our_fake(new):
                new = fake.from_tensor(new)
            if new is tensor:
                continue
            if key in sub._parameters:
                sub._parameters[key] = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
            else:
                sub._buffers[key] = new


def _scheduler_like(component: PublishedComponent, fake):
    """A scheduler (or guider) from its config, with real CPU tensors (its sigmas are read as numbers)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("cpu"):
        scheduler = component.resolve().from_config(dict(component.config))
    if fake is not None:  # an adapter deep-copies its scheduler (`ModelAdapter.__init__`); inside a FakeTensorMode a
        # real tensor cannot be copied, so this instance copies itself with the mode set aside
        scheduler.__deepcopy__ = functools.partial(_deepcopy_real, scheduler)
    return scheduler


def _deepcopy_real(obj, memo):
    """`copy.deepcopy(obj)` outside any fake mode (`obj.__deepcopy__` is this function, set per instance)."""
    import copy

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    hook = obj.__dict__.pop("__deepcopy__")
    try:
        with unset_fake_temporarily():
            twin = copy.deepcopy(obj, memo)
    finally:
        obj.__deepcopy__ = hook
    twin.__deepcopy__ = functools.partial(_deepcopy_real, twin)
    return twin


def _assemble(pipeline_cls: str, family: str, built: dict, pipeline_config: Mapping, not_built=()):
    """The pipeline from the built components, the tiny pipeline's tokenizers/processors and `pipeline_config`."""
    import diffusers

    cls = getattr(diffusers, pipeline_cls)
    parameters = inspect.signature(cls.__init__).parameters
    tiny = _tiny(family)
    kwargs = {name: module for name, module in tiny.components.items() if name in parameters}
    for name, module in built.items():
        _follow_tokenizer(module, tiny.components.get(name))
    for name, processor in kwargs.items():
        if name not in built and "image_encoder" in built:
            kwargs[name] = _follow_image_encoder(processor, built["image_encoder"])
    kwargs.update(built)
    kwargs.update({name: None for name in not_built if name in parameters})
    kwargs.update({key: value for key, value in pipeline_config.items() if key in parameters})
    for key, value in (("requires_safety_checker", False), ("add_watermarker", False)):
        if key in parameters:  # no safety checker is built; no watermark package here
            kwargs[key] = value
    pipe = cls(**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _follow_tokenizer(module, tiny_module) -> None:
    """A real-size text encoder's special token ids (`image_token_id`, `vision_start_token_id`, ...) set to the tiny
    pipeline's, whose tokenizer the built pipeline carries: Qwen2.5-VL finds its image slots by them."""
    config, tiny_config = getattr(module, "config", None), getattr(tiny_module, "config", None)
    if config is None or tiny_config is None or not hasattr(config, "to_dict"):  # transformers configs only
        return
    for key, value in tiny_config.to_dict().items():
        if key.endswith("_token_id") and isinstance(value, int) and hasattr(config, key):
            setattr(config, key, value)


def _follow_image_encoder(processor, encoder):
    """The tiny pipeline's image processor resizing to the real-size image encoder's `image_size` (SigLIP 384, CLIP
    224), every size it sets (`height`/`width`, `shortest_edge`, the crop) at that size; anything else unchanged."""
    config = getattr(encoder, "config", None)
    side = getattr(getattr(config, "vision_config", config), "image_size", None)
    if (
        not isinstance(side, int)
        or not callable(getattr(processor, "to_dict", None))
        or not hasattr(processor, "size")
    ):
        return processor
    settings = processor.to_dict()
    for key in ("size", "crop_size"):
        if isinstance(settings.get(key), dict):
            settings[key] = {k: side for k, v in settings[key].items() if v is not None}
    return type(processor).from_dict(settings)


def build_pipeline(name_or_path, *, family: str | None = None, dtype: torch.dtype = torch.bfloat16, device=None):
    """The family's diffusers pipeline with real-size networks built from a published config, reading no weights.

    Args:
        name_or_path: a published hub id (`published_checkpoints()`), a `save_pretrained` folder (built from its own
            `model_index.json` and component `config.json` files; tokenizers, processors and the scheduler are read
            from the folder) or `tiny:<family>` (the family's tiny pipeline, as `tiny(seed=0)` builds it).
        family (`str`, *optional*): the flowrl family; from the checkpoint (or `model_index.json`) when omitted, and
            checked against it when given.
        dtype (`torch.dtype`, defaults to bf16): the dtype of every network's parameters and buffers.
        device: where parameters live: `meta` by default (nothing allocated); inside a `FakeTensorMode` the modules
            are built in it as fake tensors on `cpu` (the default there).
    """
    from flowrl.models.families import MODEL_FAMILIES
    from flowrl.models.loaders import TINY_PREFIX, detect_family

    fake = _fake_mode()
    device = torch.device(device or ("cpu" if fake is not None else "meta"))
    name = str(name_or_path)
    if name.startswith(TINY_PREFIX):
        tiny_family = name[len(TINY_PREFIX) :]
        MODEL_FAMILIES.get(tiny_family)  # an unknown family fails naming the registered ones
        return MODEL_FAMILIES.get(tiny_family).tiny(seed=0)
    path = Path(name).expanduser()
    if path.is_dir():
        found = detect_family(path)
        if family is not None and family != found:
            raise ValueError(f"{path} holds a {found!r} pipeline, not {family!r}")
        return _build_folder(path, found, dtype, device, fake)
    checkpoint = published(name)
    if family is not None and not checkpoint.serves(family):
        raise ValueError(f"{name} is a {checkpoint.family!r} checkpoint, not {family!r}")
    family = family or checkpoint.family
    built = {}
    for slot, component in checkpoint.components.items():
        built[slot] = (
            _scheduler_like(component, fake) if slot in _NOT_MODULES else _build_module(component, dtype, device, fake)
        )
    pipeline = checkpoint.pipeline_of(family)
    return _assemble(pipeline, family, built, checkpoint.pipeline_config, checkpoint.not_built)


def _build_folder(path: Path, family: str, dtype, device, fake):
    """A pipeline from a `save_pretrained` folder: networks from each `config.json` (no weights read), everything
    else (tokenizers, processors, scheduler) loaded from the folder."""

    from flowrl.models.families import MODEL_FAMILIES

    index = json.loads((path / "model_index.json").read_text())
    preloaded = MODEL_FAMILIES.get(family).pipeline_load_kwargs(str(path))
    built, not_built, pipeline_config = {}, [], {}
    for slot, value in index.items():
        if slot.startswith("_"):
            continue
        if not (isinstance(value, list) and len(value) == 2):
            pipeline_config[slot] = value
            continue
        library, cls_name = value
        if cls_name is None:
            not_built.append(slot)
        elif slot in preloaded:
            built[slot] = preloaded[slot]
        elif _has_weights(library, cls_name):
            config = json.loads((path / slot / "config.json").read_text())
            config = {k: v for k, v in config.items() if not k.startswith("_")}
            if library == "transformers":
                config = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
            component = PublishedComponent(slot, cls_name, library, config)
            built[slot] = _build_module(component, dtype, device, fake)
        else:
            built[slot] = getattr(_library(library), cls_name).from_pretrained(path / slot)
    return _assemble(index["_class_name"], family, built, pipeline_config, not_built)


def _has_weights(library: str, cls_name: str) -> bool:
    module = _library(library)
    found = getattr(module, cls_name, None) if module is not None else None
    return isinstance(found, type) and issubclass(found, torch.nn.Module)


def parameter_counts(name_or_path) -> dict[str, int]:
    """Parameters of each network component (transformer / unet, text encoders, VAE) from a meta build."""
    pipe = build_pipeline(name_or_path, device="meta")
    return {
        slot: sum(p.numel() for p in module.parameters())
        for slot, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }


__all__ = [
    "PublishedCheckpoint", "PublishedComponent", "build_pipeline", "parameter_counts", "published",
    "published_checkpoints",
]  # fmt: skip
