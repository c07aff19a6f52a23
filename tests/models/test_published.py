"""Published architecture configs (`flowrl/models/published/*.json`) and the real-size pipelines built from them
without weights (`flowrl.models.published`): on `meta`, and as fake tensors under a `FakeTensorMode`."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from flowrl.models.families import MODEL_FAMILIES
from flowrl.models.published import (
    _library,
    build_pipeline,
    parameter_counts,
    published,
    published_checkpoints,
)
from flowrl.policies import DiffusionPolicy


ROOT = Path(__file__).resolve().parents[2]
CHECKPOINTS = published_checkpoints()


def _stated_sizes(family: str) -> dict[str, float]:
    """hub id -> the trained network's size in parameters, as the family's `real_models` states it (`"...: 2.5B"`;
    Wan 2.2 A14B: `2 x 14B experts`, each expert)."""
    sizes = {}
    for entry in MODEL_FAMILIES.get(family).real_models:
        name, _, size = entry.partition(": ")
        sizes[name] = float(re.search(r"([\d.]+)B", size).group(1)) * 1e9
    return sizes


def _docs_rows() -> dict[str, str]:
    """hub id -> its row of the parameter table in docs/models.md ("Published architecture configs")."""
    text = (ROOT / "docs" / "models.md").read_text().split("## Published architecture configs", 1)[-1]
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+/[^`]+)` \|.*\|$", text, re.MULTILINE)}


def _recipes() -> list[tuple[str, str | None]]:
    """(model.name, model.family) of every shipped recipe that names a hub checkpoint (tiny.yaml excluded)."""
    found = []
    for path in sorted(ROOT.glob("configs/*/*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        name = model.get("name", "")
        if path.name != "tiny.yaml" and isinstance(name, str) and name.count("/") == 1:
            found.append((name, model.get("family")))
    return found


@pytest.mark.parametrize("family", MODEL_FAMILIES.names())
def test_every_family_publishes_every_real_model(family):
    names = published_checkpoints(family)
    assert names, f"family {family!r} has no published config in flowrl/models/published/"
    assert set(_stated_sizes(family)) <= set(names), f"{family}: real_models without a published config"
    for name in names:
        assert published(name).serves(family)  # its own family, or one it loads as too (`also`)
        assert published(name).pipeline_of(family) == MODEL_FAMILIES.get(family).pipeline_class


def test_every_recipe_names_a_published_checkpoint():
    recipes = _recipes()
    assert len(recipes) >= 15  # sd35m, flux, flux2, klein, qwen x3, z_image, sana, sdxl, sd15, wan x2, hunyuan, ...
    for name, family in recipes:
        assert published(name).serves(family or published(name).family), name


def test_component_classes_exist_in_their_libraries():
    for name in CHECKPOINTS:
        checkpoint = published(name)
        assert checkpoint.trained, f"{name}: no transformer / unet component"
        for slot, component in checkpoint.components.items():
            cls = component.resolve()  # fails naming the component and class
            assert component.sources, f"{name}: {slot} says nowhere where its values were read"
            modules = slot not in ("scheduler", "guider")
            assert issubclass(cls, torch.nn.Module) == modules, f"{name}: {slot} is a {cls.__name__}"


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_meta_build_matches_the_stated_size(name):
    checkpoint = published(name)
    pipe = build_pipeline(name)  # meta, bf16: nothing allocated
    assert type(pipe).__name__ == checkpoint.pipeline
    stated = _stated_sizes(checkpoint.family)[name]
    for slot in checkpoint.trained:
        module = getattr(pipe, slot)
        assert {p.device.type for p in module.parameters()} == {"meta"}
        assert {p.dtype for p in module.parameters()} <= {torch.bfloat16, torch.float32}
        count = sum(p.numel() for p in module.parameters())
        assert abs(count / stated - 1) <= 0.12, (
            f"{name}: {slot} has {count:,} parameters, real_models says {stated:,.0f}"
        )
    DiffusionPolicy.from_pipeline(pipe)  # the family adapter accepts it

    def billions(*slots):
        return " + ".join(f"{sum(p.numel() for p in getattr(pipe, s).parameters()) / 1e9:.3f}B" for s in slots)

    encoders = sorted(s for s in checkpoint.components if s.startswith("text_encoder"))
    cells = [
        f"`{name}`",
        f"`{checkpoint.family}`",
        billions(*checkpoint.trained),
        billions(*encoders),
        billions("vae"),
    ]
    row = "| " + " | ".join(cells) + " |"
    assert _docs_rows().get(name) == row, "docs/models.md's parameter table is stale"


def test_parameter_counts_equal_counts_read_off_real_checkpoints():
    # diffusers' `ModelMixin.num_parameters` docstring: the SD1.5 UNet loaded from the hub has 859,520,964
    assert parameter_counts("stable-diffusion-v1-5/stable-diffusion-v1-5")["unet"] == 859_520_964
    # a public Z-Image port counted 6,154,908,736 parameters in the downloaded transformer
    assert parameter_counts("Tongyi-MAI/Z-Image")["transformer"] == 6_154_908_736


def test_unknown_names_and_families_fail_in_one_line():
    with pytest.raises(ValueError, match="no published config for 'acme/model'; known: .*Qwen/Qwen-Image"):
        published("acme/model")
    with pytest.raises(ValueError, match="is a 'sd3' checkpoint, not 'flux'"):
        build_pipeline("stabilityai/stable-diffusion-3.5-medium", family="flux")
    # a text-to-video checkpoint that an image-to-video pipeline loads too (`also`) builds as either
    assert type(build_pipeline("Lightricks/LTX-2", family="ltx2_i2v")).__name__ == "LTX2ImageToVideoPipeline"
    assert published_checkpoints("ltx2_i2v") == ["Lightricks/LTX-2"]
    assert published_checkpoints("wan") == [
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    ]


def test_classes_of_pipeline_modules_build_at_their_published_size():
    """LTX-2's text connectors and vocoder live in `diffusers.pipelines.ltx2` (the top level omits them): the
    published config names that module and the meta build has their real sizes, not the tiny pipeline's."""
    assert _library("ltx2") is _library("diffusers.pipelines.ltx2") is not None
    assert _library("acme.models") is None
    pipe = build_pipeline("Lightricks/LTX-2")
    connectors, vocoder = pipe.connectors, pipe.vocoder
    assert type(connectors).__name__ == "LTX2TextConnectors" and type(vocoder).__name__ == "LTX2Vocoder"
    # the Gemma-3 12B's 49 stacked hidden states (3840 wide) projected in: 188,160 x 3,840 weights
    proj = connectors.text_proj_in
    assert (proj.in_features, proj.out_features) == (3840 * 49, 3840)
    assert sum(p.numel() for p in connectors.parameters()) > 1.4e9
    assert all(p.device.type == "meta" for p in (*connectors.parameters(), *vocoder.parameters()))


def test_tokenizers_and_image_processors_follow_the_real_size_encoders():
    """The tiny twin's tokenizer and image processor, set to what the real-size networks expect: Qwen2.5-VL finds the
    image slots by the tokenizer's own `<|image_pad|>` id, SigLIP's processor resizes to its 384 px (not 32)."""
    edit = build_pipeline("Qwen/Qwen-Image-Edit")
    tokenizer = edit.processor.tokenizer
    assert edit.text_encoder.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert edit.text_encoder.config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    i2v = build_pipeline("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v")
    assert (i2v.feature_extractor.size.height, i2v.feature_extractor.size.width) == (384, 384)
    wan = build_pipeline("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
    assert wan.image_processor.size.shortest_edge == 224 and wan.image_processor.crop_size.height == 224


def test_a_save_pretrained_folder_builds_on_meta_with_its_own_sizes(tmp_path):
    tiny = MODEL_FAMILIES.get("sd3").tiny(seed=0)
    tiny.save_pretrained(tmp_path)
    pipe = build_pipeline(tmp_path)

    def counts(p):
        return {k: sum(x.numel() for x in m.parameters()) for k, m in p.components.items() if hasattr(m, "parameters")}

    assert counts(pipe) == counts(tiny)
    assert {next(m.parameters()).device.type for m in pipe.components.values() if hasattr(m, "parameters")} == {"meta"}
    again = build_pipeline("tiny:sd3")  # the tiny pipeline itself: real CPU weights, the same seed's
    assert counts(again) == counts(tiny)
    assert torch.equal(again.transformer.proj_out.weight, tiny.transformer.proj_out.weight)


REAL_512 = {
    # latents at 512 px (VAE 8x; Flux and Qwen-Image pack 2x2: 32 x 32 tokens) and conditioning at the families'
    # default text lengths (SD3: CLIP 77 + T5 256 tokens)
    "stabilityai/stable-diffusion-3.5-medium": (
        (1, 16, 64, 64),
        {"prompt_embeds": (1, 77 + 256, 4096), "pooled": (1, 2048)},
    ),
    "black-forest-labs/FLUX.1-dev": ((1, 32 * 32, 64), {"prompt_embeds": (1, 512, 4096), "pooled": (1, 768)}),
    "Qwen/Qwen-Image-2512": ((1, 32 * 32, 64), {"prompt_embeds": (1, 512, 3584), "prompt_embeds_mask": (1, 512)}),
}


@pytest.mark.parametrize("name", sorted(REAL_512))
def test_fake_tensor_build_runs_the_adapter_forward_at_real_shapes(name):
    latent_shape, cond_shapes = REAL_512[name]
    with FakeTensorMode():
        pipe = build_pipeline(name)  # fake CPU tensors: no memory
        adapter = DiffusionPolicy.from_pipeline(pipe).adapter
        assert all(isinstance(p, FakeTensor) for p in adapter.model.parameters())
        latents = torch.randn(latent_shape, dtype=torch.bfloat16)
        cond = {
            k: torch.ones(s, dtype=torch.long) if k.endswith("mask") else torch.randn(s, dtype=torch.bfloat16)
            for k, s in cond_shapes.items()
        }
        out = adapter.forward(latents, torch.full((1,), 500.0), cond, 4.0, static=adapter.static_inputs(512, 512))
    assert isinstance(out, FakeTensor) and out.shape == latents.shape and out.dtype == torch.bfloat16
