"""Build (and cache) the arithmetic world's base model: a tiny, deliberately under-trained causal LM.

    python -m flowrl.llm.build               # prints the cache folder and its build.json

The tokenizer has one token per character of `arith.ALPHABET` plus `<pad> <bos> <eos> <unk>`, built offline
with `tokenizers` and wrapped in a `PreTrainedTokenizerFast` that left-pads (generation batches are left-padded)
and starts every text with `<bos>`. The model is a `LlamaForCausalLM` from a config (no hub access), trained by
teacher forcing on `<bos> prompt answer <eos>` with the loss on the answer and `<eos>` only, for few enough steps
that sampling at temperature 1 solves only some of the test problems: RL has headroom. Everything is seeded, so
the same `BuildConfig` gives the same weights; the folder name is a hash of the config, and it is written to a
temporary folder and renamed, so an interrupted build never leaves a half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flowrl.cache import build_once, cache_root, write_atomic
from flowrl.llm.arith import ALPHABET, BOS, EOS, MAX_OPERAND, PAD, UNK, all_problems, make_problems
from flowrl.rewards.text import arith_reward


FORMAT_VERSION = 1
MAX_NEW_TOKENS = len(str(2 * MAX_OPERAND)) + 2
"""Default generation length (saved in the generation config): the longest answer and `<eos>`, plus one."""
BUILD_THREADS = 1
"""torch threads while building: the matrices are tiny, so more threads only add waiting (20x slower beside
another busy process on 2 cores), and a fixed count keeps the weights bit-identical across machines."""


@dataclass(frozen=True)
class BuildConfig:
    """How the arithmetic base model is built. Changing any field builds (and caches) a different model."""

    seed: int = 0
    """Seeds the initial weights, the training problems and the sampled accuracy check."""
    train_steps: int = 700
    """Teacher-forcing steps: few, so that sampled test accuracy starts near 0.3 (seeds 0-2: 0.30, 0.22, 0.26)."""
    batch_size: int = 64
    """Problems per step (each step draws fresh train problems, with replacement)."""
    lr: float = 3e-3
    """AdamW learning rate (constant, after a linear warm-up over the first 10% of the steps)."""
    hidden_size: int = 64
    """Width of the residual stream (tied input and output embeddings; the MLP is 4x wider)."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (`hidden_size` must be divisible by it)."""
    eval_samples: int = 4
    """Samples per test problem behind the sampled accuracy in build.json (greedy takes one)."""

    def key(self) -> str:
        """Hash of the config (and the format version): the cache folder's suffix."""
        blob = json.dumps({"version": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_dir(config: BuildConfig) -> Path:
    """The cache folder of `config`: `<cache_root>/llm/arith-<hash>`."""
    return cache_root() / "llm" / f"arith-{config.key()}"


def make_tokenizer():
    """The character-level tokenizer: ids 0-3 are `<pad> <bos> <eos> <unk>`, then one id per `ALPHABET` char."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: i for i, token in enumerate(specials + list(ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, "\n" too
    backend.decoder = decoders.Fuse()  # join the characters back without spaces
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def make_model(config: BuildConfig, tokenizer):
    """A freshly initialised `LlamaForCausalLM` sized by `config` (seed torch first for reproducible weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.hidden_size % config.num_heads:
        raise ValueError(f"hidden_size {config.hidden_size} is not divisible by num_heads {config.num_heads}")
    lm_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=4 * config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(lm_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    return model


def encode(tokenizer, prompts: list[str], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded `<bos> prompt answer <eos>`: ids `[N, T]`, attention mask `[N, T]`, answer mask `[N, T]`.

    The answer mask is 1 on the answer's tokens and `<eos>` (the tokens the loss predicts).
    """
    texts = [p + a + EOS for p, a in zip(prompts, answers)]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]  # [N, T]
    answer_len = torch.tensor([len(a) + 1 for a in answers])  # one token per character, then <eos>
    from_end = torch.arange(ids.shape[1] - 1, -1, -1)  # [T]: tokens after this one
    answer_mask = (from_end[None, :] < answer_len[:, None]).long()  # [N, T]
    return ids, mask, answer_mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token (what `generate` uses on a left-padded batch)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def answer_loss(model, ids: torch.Tensor, mask: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy of the answer tokens given everything before them."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits  # [N, T, V]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [N, T-1, V]: predicts tokens 1..T-1
    token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [N, T-1]
    weight = answer_mask[:, 1:].float()  # [N, T-1]
    return -(token_logp * weight).sum() / weight.sum()


def pretrain(model, tokenizer, config: BuildConfig, log=print) -> list[float]:
    """Teacher forcing on fresh train problems each step; returns the per-step losses."""
    problems = make_problems(config.train_steps * config.batch_size, config.seed, "train")
    ids, mask, answer_mask = encode(tokenizer, [p.prompt for p in problems], [p.answer for p in problems])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    warmup = max(1, config.train_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    losses = []
    for step in range(config.train_steps):
        rows = slice(step * config.batch_size, (step + 1) * config.batch_size)
        batch_mask = mask[rows]
        trim = int(batch_mask.sum(-1).max())  # drop the columns that are padding in every row
        loss = answer_loss(model, ids[rows, -trim:], batch_mask[:, -trim:], answer_mask[rows, -trim:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log and (step + 1) % 100 == 0:
            log(f"  pretrain step {step + 1}/{config.train_steps}: loss {sum(losses[-100:]) / 100:.4f}")
    return losses


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], *, do_sample: bool, batch_size: int = 256) -> list[str]:
    """The model's completions of `prompts` (special tokens dropped), by left-padded batched `generate`."""
    model.eval()
    completions = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start : start + batch_size], padding=True, return_tensors="pt")
        out = model.generate(
            **batch,
            do_sample=do_sample,
            temperature=1.0 if do_sample else None,
            top_k=None,
            top_p=None,
            max_new_tokens=MAX_NEW_TOKENS,
        )
        completions += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return completions


def accuracy(model, tokenizer, problems, *, do_sample: bool) -> float:
    """Exact-match accuracy of the model's completions (sampled at temperature 1, or greedy)."""
    completions = complete(model, tokenizer, [p.prompt for p in problems], do_sample=do_sample)
    return arith_reward(completions, [p.answer for p in problems]).mean().item()


def build(config: BuildConfig | None = None, *, force: bool = False, log=print) -> Path:
    """Build (unless cached) the tokenizer and the base model; returns their folder (see `load`)."""
    config = config or BuildConfig()

    def build_here(target: Path) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(BUILD_THREADS)
        try:
            _build(config, target, log)
        finally:
            torch.set_num_threads(threads)

    # under the cache's lock: a second process (another run, or a rank) waits and reuses this build; without it, its
    # own build replaced the folder while the first was loading from it
    return build_once(model_dir(config), force, build_here, marker="build.json")


def _build(config: BuildConfig, target: Path, log) -> None:
    start = time.time()
    if log:
        log(f"building the arithmetic base model into {target} (once; about 20 s on a CPU core)")
    torch.manual_seed(config.seed)
    tokenizer = make_tokenizer()
    model = make_model(config, tokenizer)
    losses = pretrain(model, tokenizer, config, log=log)
    train_seconds = time.time() - start
    test = all_problems("test")
    torch.manual_seed(config.seed + 1)  # the sampled check
    sampled = accuracy(model, tokenizer, test * config.eval_samples, do_sample=True)
    greedy = accuracy(model, tokenizer, test, do_sample=False)

    def write(tmp: Path):
        model.eval().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {
            "format_version": FORMAT_VERSION,
            "config": asdict(config),
            "test_accuracy_sampled": round(sampled, 4),
            "test_accuracy_greedy": round(greedy, 4),
            "test_problems": len(test),
            "final_pretrain_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "train_seconds": round(train_seconds, 1),
            "build_seconds": round(time.time() - start, 1),
            "torch": torch.__version__,
        }
        (tmp / "build.json").write_text(json.dumps(meta, indent=2))

    write_atomic(target, write)
    if log:
        log(
            f"arithmetic base model built in {time.time() - start:.0f} s: test accuracy {sampled:.2f} sampled, "
            f"{greedy:.2f} greedy"
        )


def load(path: str | Path):
    """`(model, tokenizer)` of a built folder: a fresh fp32 `LlamaForCausalLM` in eval mode and its tokenizer."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "build.json").is_file():
        raise FileNotFoundError(f"{path} is not a built arithmetic model (no build.json); run flowrl.llm.build")
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(path)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flowrl.llm.build", description="build and cache the arith LM")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache has it")
    parser.add_argument("--train-steps", type=int, default=BuildConfig.train_steps)
    parser.add_argument("--lr", type=float, default=BuildConfig.lr)
    parser.add_argument("--seed", type=int, default=BuildConfig.seed)
    args = parser.parse_args(argv)
    path = build(BuildConfig(seed=args.seed, train_steps=args.train_steps, lr=args.lr), force=args.force)
    print(path)
    print(json.dumps(json.loads((path / "build.json").read_text()), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
