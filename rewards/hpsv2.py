"""HPS v2.1 (Human Preference Score v2, Wu et al. 2023, arXiv:2306.09341): open_clip ViT-H-14 fine-tuned on HPD v2.

`r = <E_img(x), E_txt(c)>` with unit-norm CLIP features, the diagonal of `img_feat @ txt_feat^T` as in the
official `hpsv2` scorer (DanceGRPO, MixGRPO, DiffusionNFT use it as is; typical values 0.2-0.35). Weights:
`HPS_v2.1_compressed.pt` from the hub repo `xswu/HPSv2`, a dict `{"state_dict": ...}` of tensors that loads
with `weights_only=True`. The open_clip weights run as a transformers `CLIPModel` (`openclip_to_hf`), with the
tokenizer and image transform of open_clip's ViT-H-14 (`laion/CLIP-ViT-H-14-laion2B-s32B-b79K`'s): no open_clip,
no torchvision. Differentiable.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward
from flowrl.rewards.heads import strip_prefix
from flowrl.rewards.loading import download_hint, load_state_dict, resolve_file


HPS_REPO = "xswu/HPSv2"
HPS_FILE = "HPS_v2.1_compressed.pt"
PROCESSOR_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # open_clip's ViT-H-14 tokenizer and transform


def hps_state_dict(reward: str, path) -> dict[str, torch.Tensor]:
    """The open_clip state dict inside an HPS checkpoint (`{"state_dict": ...}` or a bare state dict)."""
    state = load_state_dict(reward, path)
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    return strip_prefix(state, ("module.",))


@register(
    "hpsv2",
    description=(
        f"HPS v2.1: cos(text, image) of open_clip ViT-H-14 fine-tuned on HPD v2, differentiable (needs: {HPS_FILE} "
        f"from {HPS_REPO} + tokenizer of {PROCESSOR_REPO})"
    ),
)
class HPSv2(Reward):
    """Human Preference Score v2.1: cosine similarity of open_clip ViT-H-14 features fine-tuned on HPD v2.

    Args:
        checkpoint (`str`, defaults to `"xswu/HPSv2"`): the `HPS_v2.1_compressed.pt` file, a folder holding it,
            or a hub repo id to download it from (`HPS_v2_compressed.pt` in the same repo is HPS v2.0).
        processor (`str`, defaults to `"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"`): hub id or local folder of the
            tokenizer (and `preprocessor_config.json`; without one, open_clip's transform: shortest side to the
            model's size, bicubic, centre crop, OpenAI CLIP's mean and std).
        arch (`str`, defaults to `"ViT-H-14"`): the open_clip architecture of the checkpoint (its head counts and
            activation; one of `OPEN_CLIP_ARCHS`).
        device, dtype, batch_size: see `Reward`.
    """

    differentiable = True

    def __init__(
        self,
        checkpoint: str = HPS_REPO,
        processor: str = PROCESSOR_REPO,
        arch: str = "ViT-H-14",
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        from flowrl.rewards.clip_models import HFCLIP
        from flowrl.rewards.openclip_to_hf import OPEN_CLIP_ARCHS, open_clip_to_clip

        if arch not in OPEN_CLIP_ARCHS:
            raise ValueError(f"reward 'hpsv2': unknown arch {arch!r}; choose one of {sorted(OPEN_CLIP_ARCHS)}")
        fix = (
            f"run {download_hint(HPS_REPO, [HPS_FILE])} and pass checkpoint=DIR/{HPS_FILE} "
            "(config: `rewards: [{name: hpsv2, kwargs: {checkpoint: PATH}}]`)"
        )
        path = resolve_file(self.name, checkpoint, [HPS_FILE, "HPS_v2_compressed.pt"], what="HPS checkpoint", fix=fix)
        try:
            model = open_clip_to_clip(hps_state_dict(self.name, path), OPEN_CLIP_ARCHS[arch])
        except ValueError as err:
            raise ValueError(f"reward 'hpsv2': {str(path)!r}: {err}") from err
        self.clip = HFCLIP(
            self.name,
            model,
            processor,
            default_repo=HPS_REPO,
            default_processor=PROCESSOR_REPO,
            device=self.device,
            dtype=self.dtype,
        )
        eos, ends = model.config.text_config.eos_token_id, self.clip.tokenizer.eos_token_id
        if ends != eos:  # the text feature is read at the first end-of-text token
            raise ValueError(
                f"reward 'hpsv2': the tokenizer at {processor!r} ends text with id {ends}, "
                f"the checkpoint's vocabulary with {eos}: pass the tokenizer of {PROCESSOR_REPO}"
            )

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        return (self.clip.encode_image(images) * self.clip.encode_text(prompts)).sum(-1)
