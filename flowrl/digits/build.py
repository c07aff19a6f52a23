"""Build (and cache) the digits world: a deliberately under-trained flow model and two digit classifiers.

    python -m flowrl.digits.build            # or `flowrl digits build`; prints the cache folder

The base model is an `SD3Transformer2DModel` trained by rectified flow on scikit-learn's digits, conditioned
on MiniLM embeddings of the training phrasings, for few enough steps that RL has headroom. Everything is
seeded, so the same `BuildConfig` gives the same weights; the folder name is a hash of the config, and it
is written to a temporary folder and renamed, so an interrupted build never leaves a half-written cache.
The classifiers are cached apart from the base model: they do not depend on how the model is pretrained.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowrl.cache import build_once as _build_once
from flowrl.cache import cache_lock, cache_root  # noqa: F401 (re-exported)
from flowrl.cache import write_atomic as _write_atomic
from flowrl.digits.data import digit_of, read_prompts, real_digits, split
from flowrl.digits.nets import DigitCNN, DigitMLP, MiniLMEncoder, TransformerConfig, accuracy, train_classifier


FORMAT_VERSION = 1


@dataclass(frozen=True)
class BuildConfig:
    """How the digits world is built. Changing any field builds (and caches) a different world."""

    seed: int = 0
    """Seeds pretraining and classifier training."""
    pretrain_steps: int = 220
    """Rectified-flow steps of the base model: few, so that test-prompt alignment (no CFG) starts near 0.55."""
    batch_size: int = 128
    """Pretraining batch size."""
    lr: float = 1e-3
    """AdamW learning rate of pretraining."""
    cond_dropout: float = 0.1
    """Probability of replacing the prompt by "" in pretraining (what classifier-free guidance needs)."""
    classifier_epochs: int = 30
    """Epochs of each classifier."""
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    """The flow model's size."""

    def model_key(self) -> str:
        """Hash of what the base model depends on (not the classifiers' settings)."""
        fields = asdict(self)
        fields.pop("classifier_epochs")
        return _hash(fields)

    def classifier_key(self) -> str:
        """Hash of what the classifiers depend on (not the base model's settings)."""
        return _hash({"seed": self.seed, "classifier_epochs": self.classifier_epochs})


def _hash(fields: dict) -> str:
    blob = json.dumps({"version": FORMAT_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_dir(config: BuildConfig) -> Path:
    return cache_root() / "digits" / f"model-{config.model_key()}"


def classifier_dir(config: BuildConfig) -> Path:
    return cache_root() / "digits" / f"classifiers-{config.classifier_key()}"


def pretrain(transformer, encoder: MiniLMEncoder, config: BuildConfig, log=print) -> list[float]:
    """Rectified flow: `x_s = (1 - s) x0 + s eps`, target `eps - x0`, logit-normal `s`, prompt dropout."""
    images, labels = real_digits()
    x_data = images * 2 - 1  # [N, 1, 8, 8] in [-1, 1]
    prompts = read_prompts("train")
    by_digit = [[i for i, p in enumerate(prompts) if digit_of(p) == d] for d in range(10)]
    cond = encoder.encode(prompts + [""])  # the last row is the unconditional prompt
    null = len(prompts)
    g = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=config.lr, weight_decay=0.0)
    transformer.train()
    losses = []
    for step in range(config.pretrain_steps):
        idx = torch.randint(len(x_data), (config.batch_size,), generator=g)
        x0, y = x_data[idx], labels[idx]
        pick = torch.randint(10**6, (config.batch_size,), generator=g)
        rows = torch.tensor([by_digit[d][k % len(by_digit[d])] for d, k in zip(y.tolist(), pick.tolist())])
        rows = torch.where(torch.rand(config.batch_size, generator=g) < config.cond_dropout, null, rows)
        sigma = torch.sigmoid(torch.randn(config.batch_size, generator=g))  # logit-normal(0, 1)
        eps = torch.randn(x0.shape, generator=g)
        s = sigma.view(-1, 1, 1, 1)
        x_s = (1 - s) * x0 + s * eps
        v = transformer(
            hidden_states=x_s,
            timestep=sigma * 1000,
            encoder_hidden_states=cond["prompt_embeds"][rows],
            pooled_projections=cond["pooled"][rows],
        ).sample
        loss = torch.nn.functional.mse_loss(v, eps - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log and (step + 1) % 50 == 0:
            log(f"  pretrain step {step + 1}/{config.pretrain_steps}: loss {sum(losses[-50:]) / 50:.4f}")
    return losses


def build_classifiers(config: BuildConfig, *, force: bool = False, log=print) -> Path:
    """Train the reward CNN (on half A of the real digits) and the gold MLP (on half B) into the cache."""
    return _build_once(classifier_dir(config), force, lambda target: _train_classifiers(config, target, log))


def _train_classifiers(config: BuildConfig, target: Path, log) -> None:
    start = time.time()
    images, labels = real_digits()
    part_a, part_b = split(config.seed)
    torch.manual_seed(config.seed + 1)
    reward_clf = train_classifier(
        DigitCNN(), images[part_a], labels[part_a], epochs=config.classifier_epochs, seed=config.seed + 1
    )
    torch.manual_seed(config.seed + 2)
    gold_clf = train_classifier(
        DigitMLP(), images[part_b], labels[part_b], epochs=config.classifier_epochs, seed=config.seed + 2
    )

    def write(tmp: Path):
        save_file(reward_clf.state_dict(), tmp / "reward_classifier.safetensors")
        save_file(gold_clf.state_dict(), tmp / "gold_classifier.safetensors")
        meta = {
            "format_version": FORMAT_VERSION,
            "seed": config.seed,
            "classifier_epochs": config.classifier_epochs,
            # each classifier is validated on the half of the data the other one trained on
            "reward_classifier_accuracy": accuracy(reward_clf, images[part_b], labels[part_b]),
            "gold_classifier_accuracy": accuracy(gold_clf, images[part_a], labels[part_a]),
            "build_seconds": round(time.time() - start, 1),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _write_atomic(target, write)
    if log:
        log(f"digits classifiers trained in {time.time() - start:.0f} s: {target}")


def build_model(config: BuildConfig, *, force: bool = False, log=print) -> Path:
    """Pretrain the base flow model into the cache."""
    return _build_once(model_dir(config), force, lambda target: _pretrain_model(config, target, log))


def _pretrain_model(config: BuildConfig, target: Path, log) -> None:
    start = time.time()
    if log:
        log(f"building the digits base model into {target} (once; about 40 s on 2 CPU cores)")
    torch.manual_seed(config.seed)
    transformer = config.transformer.build()
    losses = pretrain(transformer, MiniLMEncoder(), config, log=log)

    def write(tmp: Path):
        transformer.eval().save_pretrained(tmp / "transformer")
        meta = {
            "format_version": FORMAT_VERSION,
            "config": asdict(config),
            "final_pretrain_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "build_seconds": round(time.time() - start, 1),
            "torch": torch.__version__,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _write_atomic(target, write)
    if log:
        log(f"digits base model built in {time.time() - start:.0f} s")


def build(config: BuildConfig | None = None, *, force: bool = False, log=print) -> tuple[Path, Path]:
    """Build (unless cached) the base model and the classifiers; returns both folders."""
    config = config or BuildConfig()
    return build_model(config, force=force, log=log), build_classifiers(config, force=force, log=log)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="flowrl digits build", description="build and cache the digits world")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache has it")
    parser.add_argument("--pretrain-steps", type=int, default=BuildConfig.pretrain_steps)
    parser.add_argument("--seed", type=int, default=BuildConfig.seed)
    args = parser.parse_args(argv)
    for path in build(BuildConfig(seed=args.seed, pretrain_steps=args.pretrain_steps), force=args.force):
        print(path)
        print(json.dumps(json.loads((path / "meta.json").read_text()), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
