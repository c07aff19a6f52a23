"""HPS v2.1 without open_clip: open_clip ViT weights converted to a transformers `CLIPModel`, checked against
open_clip's CLIP forward written out here from its definition (pre-LN blocks with a fused q/k/v projection, the
class token through `ln_post @ proj`, the text's largest id through `ln_final @ text_projection` under a causal
mask)."""

import math

import pytest
import torch
import torch.nn.functional as F

from flowrl import rewards
from flowrl.models.tiny import tiny_clip_tokenizer
from flowrl.rewards.openclip_to_hf import OPEN_CLIP_ARCHS, OpenCLIPArch, open_clip_to_clip
from flowrl.rewards.preprocess import ImageSettings
from tests.rewards.conftest import PROMPTS
from tests.rewards.tiny_models import tiny_open_clip_state


CONTEXT = 16
TINY = OpenCLIPArch(vision_head_width=32, text_head_width=32)


def _ln(x, p, name):
    return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"], eps=1e-5)


def _act(x, name):
    return x * torch.sigmoid(1.702 * x) if name == "quick_gelu" else F.gelu(x)


def _blocks(x, p, prefix, mask, act):  # x [B, L, W]
    for i in range(2):
        b = f"{prefix}transformer.resblocks.{i}."
        h = _ln(x, p, b + "ln_1")
        qkv = F.linear(h, p[b + "attn.in_proj_weight"], p[b + "attn.in_proj_bias"])  # [B, L, 3W]
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # [B, 2, L, W/2]
        weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask).softmax(-1)  # [B, 2, L, L]
        attended = (weights @ v).transpose(1, 2).flatten(2)  # [B, L, W]
        x = x + F.linear(attended, p[b + "attn.out_proj.weight"], p[b + "attn.out_proj.bias"])
        h = _act(F.linear(_ln(x, p, b + "ln_2"), p[b + "mlp.c_fc.weight"], p[b + "mlp.c_fc.bias"]), act)
        x = x + F.linear(h, p[b + "mlp.c_proj.weight"], p[b + "mlp.c_proj.bias"])
    return x


def open_clip_image(p, pixels, act="gelu"):  # pixels [B, 3, 32, 32], normalised
    patches = F.conv2d(pixels, p["visual.conv1.weight"], stride=8).flatten(2).transpose(1, 2)  # [B, 16, W]
    cls = p["visual.class_embedding"].expand(len(pixels), 1, -1)
    x = _ln(torch.cat([cls, patches], 1) + p["visual.positional_embedding"], p, "visual.ln_pre")
    x = _blocks(x, p, "visual.", 0.0, act)
    return _ln(x[:, 0], p, "visual.ln_post") @ p["visual.proj"]


def open_clip_text(p, ids, act="gelu"):  # ids [B, CONTEXT], 0-padded after the end-of-text id
    x = p["token_embedding.weight"][ids] + p["positional_embedding"]
    causal = torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1)
    x = _ln(_blocks(x, p, "", causal, act), p, "ln_final")
    return x[torch.arange(len(ids)), ids.argmax(-1)] @ p["text_projection"]


def open_clip_ids(tokenizer, prompts):
    """open_clip's tokenization: start, tokens, end, truncated to the context with end-of-text last, 0-padded."""
    rows = tokenizer(prompts, truncation=True, max_length=CONTEXT)["input_ids"]
    return torch.tensor([row + [0] * (CONTEXT - len(row)) for row in rows])


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_clip_tokenizer()


@pytest.fixture(scope="module")
def hps_dirs(tmp_path_factory, tokenizer):
    """An HPS checkpoint in the released layout (`{"state_dict": {"module.<open_clip key>": ...}}`) and a tokenizer."""
    state = tiny_open_clip_state(len(tokenizer))
    folder = tmp_path_factory.mktemp("hps")
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, folder / "HPS_v2.1_compressed.pt")
    tokenizer.save_pretrained(folder / "tokenizer")
    return folder, state


@pytest.fixture
def tiny_arch(monkeypatch):
    monkeypatch.setitem(OPEN_CLIP_ARCHS, "flowrl-tiny", TINY)


@pytest.mark.parametrize("act", ["gelu", "quick_gelu"])
def test_converted_model_computes_open_clips_features(tokenizer, act):
    state = tiny_open_clip_state(len(tokenizer))
    model = open_clip_to_clip(state, OpenCLIPArch(32, 32, act)).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ids = open_clip_ids(tokenizer, ["a cat", "a photo of a dog on the grass"])  # the second one truncated
    with torch.no_grad():
        image = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        text = model.text_projection(model.text_model(input_ids=ids).pooler_output)
    torch.testing.assert_close(image, open_clip_image(state, pixels, act), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(text, open_clip_text(state, ids, act), atol=1e-5, rtol=1e-4)
    assert model.logit_scale.item() == pytest.approx(4.6052)


def test_hpsv2_is_the_cosine_of_open_clips_features(hps_dirs, tokenizer, images, tiny_arch):
    folder, state = hps_dirs
    reward = rewards.get("hpsv2", checkpoint=str(folder), processor=str(folder / "tokenizer"), arch="flowrl-tiny")
    pixels = ImageSettings.square(32)(images)  # open_clip's transform: shortest side, centre crop, OpenAI mean/std
    expected = (
        _unit(open_clip_image(state, pixels)) * _unit(open_clip_text(state, open_clip_ids(tokenizer, PROMPTS)))
    ).sum(-1)
    scores = reward(images, PROMPTS)
    assert scores.shape == (3,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    images = images.clone().requires_grad_(True)
    reward.score(images, PROMPTS).sum().backward()
    assert images.grad.abs().sum() > 0


def test_hpsv2_missing_checkpoint(tmp_path):
    with pytest.raises(rewards.RewardWeightsError, match=r"'hpsv2'.*HPS_v2.1_compressed.pt.*hf download xswu/HPSv2"):
        rewards.get("hpsv2", checkpoint=str(tmp_path))


def test_hpsv2_refuses_an_unknown_arch():
    with pytest.raises(ValueError, match=r"unknown arch 'ViT-X'; choose one of \['ViT-B-16', .*'ViT-H-14'"):
        rewards.get("hpsv2", arch="ViT-X")


def test_hpsv2_refuses_a_checkpoint_of_another_model(tmp_path, clip_dir, tiny_arch):
    from safetensors.torch import load_file

    torch.save(load_file(str(clip_dir / "model.safetensors")), tmp_path / "HPS_v2.1_compressed.pt")
    with pytest.raises(ValueError, match=r"'hpsv2':.*not an open_clip ViT checkpoint: it has no visual.conv1.weight"):
        rewards.get("hpsv2", checkpoint=str(tmp_path), processor=str(clip_dir), arch="flowrl-tiny")


def test_hpsv2_refuses_unknown_keys_and_a_foreign_tokenizer(tmp_path, tokenizer, hps_dirs, tiny_arch):
    folder, _ = hps_dirs
    state = tiny_open_clip_state(len(tokenizer)) | {"visual.transformer.resblocks.0.ls_1.gamma": torch.ones(64)}
    torch.save(state, tmp_path / "HPS_v2.1_compressed.pt")
    with pytest.raises(ValueError, match=r"has keys visual.transformer.resblocks.0.ls_1.gamma$"):
        rewards.get("hpsv2", checkpoint=str(tmp_path), processor=str(folder / "tokenizer"), arch="flowrl-tiny")
    torch.save(tiny_open_clip_state(len(tokenizer) + 8), tmp_path / "HPS_v2.1_compressed.pt")  # another vocabulary
    ends, eos = len(tokenizer) - 1, len(tokenizer) + 7
    with pytest.raises(ValueError, match=rf"ends text with id {ends}, the checkpoint's vocabulary with {eos}"):
        rewards.get("hpsv2", checkpoint=str(tmp_path), processor=str(folder / "tokenizer"), arch="flowrl-tiny")


def test_vit_h_14_converts_at_its_real_size_on_meta():
    """open_clip's ViT-H-14 (model_configs/ViT-H-14.json: vision 32 x 1280 with heads 80 wide, patch 14, 224 px; text
    24 x 1024 with 16 heads, 77 tokens; embed 1024): the config transformers gets and every converted shape."""
    from transformers import CLIPModel

    from flowrl.rewards.openclip_to_hf import clip_config, convert_state

    state = tiny_open_clip_state(
        49408, context=77, widths=(1280, 1024), layers=(32, 24), patch=14, grid=16, embed=1024, device="meta"
    )
    config = clip_config(state, OPEN_CLIP_ARCHS["ViT-H-14"])
    vision, text = config.vision_config, config.text_config
    assert (vision.num_hidden_layers, vision.hidden_size, vision.num_attention_heads) == (32, 1280, 16)
    assert (vision.intermediate_size, vision.image_size, vision.patch_size, vision.hidden_act) == (
        5120,
        224,
        14,
        "gelu",
    )
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.intermediate_size) == (
        24,
        1024,
        16,
        4096,
    )
    assert (text.max_position_embeddings, text.eos_token_id, config.projection_dim) == (77, 49407, 1024)
    with torch.device("meta"):
        expected = CLIPModel(config).state_dict()
    converted = convert_state(state)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    assert sum(v.numel() for v in converted.values()) == sum(v.numel() for v in state.values())  # 986M
