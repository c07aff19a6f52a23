"""The training loop every image trainer shares: rollout -> rewards -> advantages -> update -> eval/log/checkpoint.

A trainer subclasses `Trainer`, pairs it with a config dataclass (a `TrainerConfig` subclass) and implements
the algorithm's own pieces: `compute_advantages` (optional), `train_steps` (which denoising steps each sample
trains) and `step_loss` (the loss of one minibatch at one step). Everything else lives here, once:

- **accelerate** runtime: one process on a CPU, `accelerate launch` for many GPUs. Each epoch's m x k prompt
  list is drawn identically on every process from `(seed, epoch)`; each process samples its contiguous share,
  rewards are gathered so group statistics are global, and each process trains on its own samples.
- **rewards**: several, weighted; NaN/inf rewards drop their sample and are counted; more than
  `run.max_bad_reward_frac` of an epoch aborts with a message naming the reward.
- **updates**: inner epochs x minibatches of `sampling.train_batch_size` (the rollout's forward chunk, so
  ratios start exactly at 1) x trained steps, one backward per step, gradients accumulated over
  `optim.gradient_accumulation` minibatches with exact per-sample weighting, clipped, then one AdamW step.
- **evaluation** on held-out prompts with fixed noise (ODE sampler), training rewards plus gold metrics and
  within-group diversity; **EMA** weights (optional) are used for evaluation.
- **run folder**: `config.yaml`, `metrics.jsonl`, TensorBoard events, image grids, PNG curves,
  `summary.json`, and `checkpoints/epoch_N/` that resume exactly (per-epoch seeding + saved state).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch

import rewards as reward_registry
from flowrl import checkpoint
from flowrl.config import (
    EvalConfig,
    ModelConfig,
    OptimConfig,
    PromptConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    save_config,
)
from flowrl.policies.diffusion import Rollout
from flowrl.tracking import MetricsLog, image_grid, plot_curves, scalar
from rewards import RewardExecutor, check_output


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class TrainerConfig:
    """What every trainer shares. Algorithm fields live in the subclasses."""

    trainer: str = ""
    """Registered trainer name (`flowrl list trainers`)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy's model."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Rollouts."""
    prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    """Prompt sets and the m x k grouping."""
    rewards: list[RewardConfig] = dataclasses.field(default_factory=lambda: [RewardConfig()])
    """Rewards and their weights."""
    reward_aggregation: Literal["sum", "gdpo"] = "sum"
    """`sum`: advantages of the weighted reward sum (Flow-GRPO); `gdpo`: per-reward group advantages, weighted."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation on the test prompts."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and gradient handling."""
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    """Run folder, epochs, seeds, logging, checkpoints."""
    inner_epochs: int = 1
    """Passes over each epoch's samples (PPO epochs)."""
    drop_zero_std_groups: bool = True
    """Skip training on groups whose rewards are all equal (their advantages are 0: no signal)."""
    ema_decay: float | None = None
    """EMA of the trained weights for evaluation (Flow-GRPO: 0.9); None: off."""
    ema_every: int = 8
    """Optimizer steps between EMA updates (Flow-GRPO: 8)."""

    def __post_init__(self):
        s, p = self.sampling, self.prompts
        checks = [
            (self.run.epochs >= 1, "run.epochs must be >= 1"),
            (p.prompts_per_epoch >= 1, "prompts.prompts_per_epoch must be >= 1"),
            (p.group_size >= 1, "prompts.group_size must be >= 1"),
            (s.num_steps >= 1, "sampling.num_steps must be >= 1"),
            (s.train_batch_size >= 1, "sampling.train_batch_size must be >= 1"),
            (self.inner_epochs >= 1, "inner_epochs must be >= 1"),
            (self.optim.gradient_accumulation >= 1, "optim.gradient_accumulation must be >= 1"),
            (len(self.rewards) >= 1, "rewards needs at least one reward"),
            (0 <= self.run.max_bad_reward_frac <= 1, "run.max_bad_reward_frac must lie in [0, 1]"),
            (self.ema_decay is None or 0 < self.ema_decay < 1, "ema_decay must lie in (0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator seeded from integers (e.g. `(seed, epoch, purpose)`): resumed runs draw the same numbers."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


class EMA:
    """Exponential moving average of parameters (`ema <- d ema + (1 - d) theta`)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for shadow, p in zip(self.shadow, self.params):
            shadow.lerp_(p.detach(), 1 - self.decay)

    @contextmanager
    def swapped(self):
        """Use the EMA weights inside the block."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)


class Trainer(ABC):
    """The shared loop; see the module docstring. Subclasses set `config_class` and implement `step_loss`."""

    config_class = TrainerConfig
    store_means = False
    """Rollouts keep each step's behaviour mean (GRPO-Guard's RatioNorm needs it)."""

    def __init__(self, config: TrainerConfig, *, policy=None, reward_fns: dict | None = None,
                 eval_fns: dict | None = None, output_dir=None):  # fmt: skip
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        from accelerate import Accelerator

        self.config = config
        run = config.run
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output_dir = Path(output_dir or run.output_dir.format(trainer=config.trainer, time=stamp))
        self.accelerator = Accelerator(cpu=run.cpu, mixed_precision=run.mixed_precision,
                                       log_with=run.log_with or None, project_dir=str(self.output_dir))  # fmt: skip
        self.policy = policy if policy is not None else self.build_policy()
        self.reward_fns = reward_fns if reward_fns is not None else self.build_rewards(config.rewards)
        unknown = [r.name for r in config.rewards if r.name not in self.reward_fns]
        if unknown:
            raise ValueError(f"no reward function for {unknown}")
        if eval_fns is None:
            eval_fns = {name: reward_registry.get(name) for name in config.eval.metrics}
        self.eval_fns = eval_fns
        self.reward_weights = {spec.name: spec.weight for spec in config.rewards}
        self.train_prompts = self.load_prompts(config.prompts.train)
        self.test_prompts = self.load_prompts(config.prompts.test)
        self.setup()
        module = self.trained_module()
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(self).__name__} has no trainable parameters")
        opt = config.optim
        optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay, eps=opt.eps)
        self.model, self.optimizer = self.accelerator.prepare(module, optimizer)
        if module is self.policy.model:
            self.policy.forward_module = self.model  # training forwards go through the (DDP-)prepared module
        self.params = params
        # auxiliary networks (critics, value functions) with optimizers of their own, prepared and checkpointed
        self.aux = {}
        for name, (aux_module, lr) in self.auxiliary_modules().items():
            aux_opt = torch.optim.AdamW(aux_module.parameters(), lr=lr, weight_decay=0.0)
            self.aux[name] = self.accelerator.prepare(aux_module.to(self.accelerator.device), aux_opt)
        self.ema = EMA(params, config.ema_decay) if config.ema_decay else None
        self.epoch = 0  # epochs completed
        self.optimizer_steps = 0
        self.samples_scored = 0  # samples scored by the training rewards (the run's reward budget)
        self.eval_history: list[dict] = []
        self.log: MetricsLog | None = None

    # ------------------------------------------------------------------------------------------
    # building blocks (overridable)
    # ------------------------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def build_policy(self):
        """The policy from `config.model`: the digits world or a diffusers pipeline, LoRA or full fine-tuning."""
        from flowrl.policies import DiffusionPolicy

        m, chunk = self.config.model, self.config.sampling.train_batch_size
        if m.name == "digits":
            from flowrl.digits import BuildConfig, load_world

            log = print if self.is_main else None
            world = load_world(BuildConfig(pretrain_steps=m.digits_pretrain_steps), log=log)
            policy = world.policy(forward_batch_size=chunk)
            policy.model.to(self.accelerator.device)
        else:
            policy = DiffusionPolicy.from_pretrained(m.name, family=m.family, dtype=DTYPES[m.dtype],
                                                     device=self.accelerator.device,
                                                     max_sequence_length=m.max_sequence_length,
                                                     forward_batch_size=chunk)  # fmt: skip
        if m.lora_rank > 0:
            policy.add_lora(rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.lora_targets)
            for param in policy.trainable_parameters():  # the adapter trains in fp32 over a bf16/fp16 base
                param.data = param.data.float()
        else:
            policy.model.requires_grad_(True)
        if m.gradient_checkpointing:
            policy.model.enable_gradient_checkpointing()
        return policy

    def setup(self) -> None:  # noqa: B027  (an optional hook, not an abstract method)
        """Build algorithm-specific pieces before the optimizers exist (noise policies, critics, buffers)."""

    def trained_module(self) -> torch.nn.Module:
        """The module the main optimizer trains (default: the diffusion network; FIND: its noise policy)."""
        return self.policy.model

    def auxiliary_modules(self) -> dict[str, tuple[torch.nn.Module, float]]:
        """`{name: (module, learning rate)}` of networks trained by their own optimizer (critics, value nets)."""
        return {}

    def evaluation_latents(self, prompts: list[str], generator, height, width) -> torch.Tensor | None:
        """Initial noise for evaluation rollouts (None: the policy draws it; FIND: from its noise policy)."""
        return None

    def build_rewards(self, specs: list[RewardConfig]) -> dict:
        return {spec.name: reward_registry.get(spec.name, **spec.kwargs) for spec in specs}

    @staticmethod
    def load_prompts(name: str) -> list:
        """`flowrl.prompts.Prompt`s (text + metadata, which rewards receive as keyword arguments)."""
        import prompts as prompt_sets

        return prompt_sets.load(name)

    # ------------------------------------------------------------------------------------------
    # the algorithm's pieces
    # ------------------------------------------------------------------------------------------

    def compute_advantages(self, rewards: dict[str, torch.Tensor], group_ids: torch.Tensor, prompts: list[str]):
        """`[N]` advantages of the valid samples from per-reward scores `[N]` (default: GRPO's group z-score).

        `group_ids [N]` index this epoch's distinct prompts; `prompts` are the N prompt texts (stable across
        epochs, for trackers that keep per-prompt history).
        """
        return reward_registry.combine_advantages(rewards, self.reward_weights, group_ids,
                                                  mode=self.config.reward_aggregation)  # fmt: skip

    def train_steps(self, rollout, epoch: int) -> torch.Tensor:
        """`[B, k]` denoising steps each sample trains (default: every stochastic step)."""
        steps = rollout.sde_steps
        return steps.unsqueeze(0).expand(len(rollout), -1)

    @abstractmethod
    def step_loss(self, batch, advantages: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Loss of the minibatch `batch` (a `Rollout`) at per-sample steps `steps [b]` (a mean over samples).

        Metrics may include `_ratio` and `_raw_ratio` (`[b]`, the objective's and the plain per-step ratio):
        the loop logs their mean and spread per denoising step.
        """

    # ------------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------------

    def combined_reward(self, rewards: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weighted sum of the training rewards (zero weights: logged only)."""
        from rewards.multi import weighted_sum

        return weighted_sum(rewards, self.reward_weights, len(next(iter(rewards.values()))))

    def epoch_prompts(self, epoch: int) -> list:
        """This epoch's m prompts, each repeated k times (the same list on every process)."""
        p = self.config.prompts
        g = seeded(self.config.run.seed, epoch, 1)
        order = torch.randperm(len(self.train_prompts), generator=g).tolist()
        while len(order) < p.prompts_per_epoch:  # fewer prompts than m: cycle through a reshuffle
            order += torch.randperm(len(self.train_prompts), generator=g).tolist()
        return [self.train_prompts[i] for i in order[: p.prompts_per_epoch] for _ in range(p.group_size)]

    def _local_slice(self, n: int) -> slice:
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if n % world:
            raise ValueError(f"{n} samples per epoch do not split over {world} processes")
        share = n // world
        return slice(rank * share, (rank + 1) * share)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def score(self, images, prompts: list, fns: dict) -> dict[str, torch.Tensor]:
        """Each reward on local images (prompt metadata as keyword arguments), then gathered: `{name: [N]}`."""
        texts, metadata = _texts_and_metadata(prompts)
        return {name: self._gather(check_output(name, fn(images, texts, **metadata), len(texts)))
                for name, fn in fns.items()}  # fmt: skip

    def check_rewards(self, rewards: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Valid-sample mask (finite under every reward) and counts; aborts past `run.max_bad_reward_frac`."""
        valid = torch.ones_like(next(iter(rewards.values())), dtype=torch.bool)
        bad = {}
        for name, r in rewards.items():
            finite = torch.isfinite(r)
            bad[name] = int((~finite).sum())
            valid &= finite
        frac = 1 - valid.float().mean().item()
        if frac > self.config.run.max_bad_reward_frac:
            detail = ", ".join(f"{name}: {count}" for name, count in bad.items() if count)
            raise RuntimeError(
                f"{frac:.0%} of this epoch's rewards are NaN/inf ({detail} of {len(valid)} samples), more than "
                f"run.max_bad_reward_frac={self.config.run.max_bad_reward_frac}; check the reward model(s)"
            )
        return valid, {"bad_rewards": int((~valid).sum()), **{f"bad_rewards/{k}": v for k, v in bad.items() if v}}

    # ------------------------------------------------------------------------------------------
    # one epoch
    # ------------------------------------------------------------------------------------------

    needs_sde = True
    """Whether rollouts must have a stochastic step (log-ratio trainers); AC-Flow trains on ODE samples too."""

    def sample(self, epoch: int, on_part=None):
        """Rollout of this process's share of the epoch's prompts; returns `(rollout, prompts, local)`.

        With `sampling.reward_overlap` = n > 1 the share is sampled in n parts, and `on_part(part, part_prompts)`
        runs after each (the loop starts scoring there while the next part samples).
        """
        s = self.config.sampling
        prompts = self.epoch_prompts(epoch)
        local = self._local_slice(len(prompts))
        mine = prompts[local]
        n = min(s.reward_overlap, len(mine))
        bounds = [len(mine) * i // n for i in range(n + 1)]
        self.model.eval()
        parts = []
        for i in range(n):
            rows = slice(bounds[i], bounds[i + 1])
            stream = (i,) if n > 1 else ()  # n = 1 keeps the single-call stream
            generator = seeded(self.config.run.seed, epoch, 2, self.accelerator.process_index, *stream)
            part = self.sample_part([str(p) for p in mine[rows]], generator)
            if on_part is not None:
                on_part(part, mine[rows])
            parts.append(part)
        rollout = parts[0] if n == 1 else Rollout.cat(parts)
        if self.needs_sde and not rollout.sde_mask.any():
            raise ValueError(f"sampler {s.sampler!r} with noise_level {s.noise_level} has no stochastic step to train")
        return rollout, prompts, local

    def sample_part(self, texts: list[str], generator: torch.Generator):
        """One rollout call: the policy's samples of `texts` with the configured sampler."""
        s = self.config.sampling
        with self.accelerator.autocast():
            return self.policy.rollout(texts, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                       noise_level=s.noise_level, sampler=s.sampler, sde_window=s.sde_window,
                                       generator=generator, height=s.height, width=s.width,
                                       store_means=self.store_means)  # fmt: skip

    def sample_and_score(self, epoch: int):
        """`sample` and the rewards of its images (`{name: [N]}`, gathered), scored while sampling when
        `sampling.reward_overlap` > 1 (one thread per reward). Also returns the seconds spent sampling and
        then waiting for the rewards."""
        start = time.time()
        if self.config.sampling.reward_overlap == 1:
            rollout, prompts, local = self.sample(epoch)
            sampled = time.time()
            rewards = self.score(rollout.images, prompts[local], self.reward_fns)
        else:
            rollout, prompts, local, rewards, sampled = self._sample_and_score_overlapped(epoch)
        return rollout, prompts, local, rewards, {"time/sample_s": sampled - start,
                                                  "time/reward_s": time.time() - sampled}  # fmt: skip

    def _sample_and_score_overlapped(self, epoch: int):
        """`sample` in parts, each part's rewards scored on one thread per reward while later parts sample."""
        executors = {name: RewardExecutor(fn, max_workers=1) for name, fn in self.reward_fns.items()}
        pending = []  # (rows in the part, {name: Future})

        def submit(part, part_prompts):
            texts, metadata = _texts_and_metadata(part_prompts)
            pending.append((len(texts), {name: ex.submit(part.images, texts, **metadata)
                                         for name, ex in executors.items()}))  # fmt: skip

        try:
            rollout, prompts, local = self.sample(epoch, on_part=submit)
            sampled = time.time()
            local_scores = {name: torch.cat([check_output(name, futures[name].result(), rows)
                                             for rows, futures in pending]) for name in executors}  # fmt: skip
        finally:
            for ex in executors.values():
                ex.shutdown(wait=True)
        rewards = {name: self._gather(v) for name, v in local_scores.items()}
        return rollout, prompts, local, rewards, sampled

    def update(self, rollout, advantages: torch.Tensor, trainable: torch.Tensor, epoch: int) -> dict:
        """Inner epochs x minibatches x trained steps on this process's samples (`trainable` rows)."""
        cfg = self.config
        chunk = cfg.sampling.train_batch_size
        steps = self.train_steps(rollout, epoch)  # [B, k]
        rows = trainable.nonzero().flatten()
        stats = EpochStats()
        self.model.train()
        for inner in range(cfg.inner_epochs):
            order = rows[torch.randperm(len(rows), generator=seeded(cfg.run.seed, epoch, 3, inner,
                                                                     self.accelerator.process_index))]  # fmt: skip
            minibatches = [order[i : i + chunk] for i in range(0, len(order), chunk)]
            windows = [minibatches[i : i + cfg.optim.gradient_accumulation]
                       for i in range(0, len(minibatches), cfg.optim.gradient_accumulation)]  # fmt: skip
            for window in windows:
                window_samples = sum(len(mb) for mb in window)
                micro = [(mb, j) for mb in window for j in range(steps.shape[1])]
                for n, (mb, j) in enumerate(micro):
                    batch = rollout.select(mb)
                    sync = n == len(micro) - 1
                    with nullcontext() if sync else self.accelerator.no_sync(self.model), self.accelerator.autocast():
                        loss, metrics = self.step_loss(batch, advantages[mb], steps[mb, j])
                        # exact mean over (samples x steps) of the window: each loss is a mean over its samples
                        weight = len(mb) / window_samples / steps.shape[1]
                        self.accelerator.backward(loss * weight)
                    stats.add(metrics, loss, steps[mb, j])
                grad_norm = self._optimizer_step()
                stats.add_scalar("grad_norm", grad_norm)
        return stats.summary()

    def _optimizer_step(self) -> float:
        max_norm = self.config.optim.max_grad_norm
        if max_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.params, max_norm)
        else:
            norm = torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema is not None and self.optimizer_steps % self.config.ema_every == 0:
            self.ema.update()
        return float(norm)

    def train_epoch(self, epoch: int) -> dict:
        start = time.time()
        rollout, prompts, local, rewards, times = self.sample_and_score(epoch)
        self.samples_scored += len(prompts)
        valid, bad = self.check_rewards(rewards)
        texts = [str(p) for p in prompts]
        unique = list(dict.fromkeys(texts))
        group_ids = torch.tensor([unique.index(p) for p in texts])
        advantages = torch.zeros(len(prompts))
        valid_rewards = {k: v[valid] for k, v in rewards.items()}
        valid_texts = [t for t, ok in zip(texts, valid.tolist()) if ok]
        adv, adv_stats = self.compute_advantages(valid_rewards, group_ids[valid], valid_texts)
        advantages[valid] = adv.float()
        trainable = valid.clone()
        if self.config.drop_zero_std_groups:
            trainable &= _informative_groups(group_ids, advantages, valid)
        local_adv, local_trainable = advantages[local], trainable[local]
        t0 = time.time()
        train = self.update(rollout, local_adv, local_trainable, epoch) if local_trainable.any() else {}
        total = self.combined_reward(valid_rewards)
        record = {
            "epoch": epoch + 1,
            "reward/mean": total.mean(),
            "reward/std": total.std() if len(total) > 1 else 0.0,
            **{f"reward/{name}": r[valid].mean() for name, r in rewards.items()},
            **{f"adv/{k}": v for k, v in adv_stats.items()},
            **bad,
            "trained_samples": int(self._gather(local_trainable.float()).sum()),
            **train,
            **times,
            "time/train_s": time.time() - t0,
            "time_s": time.time() - start,
        }
        self._last_rollout = rollout if self.is_main else None
        self._last_rewards = {k: v[local] for k, v in rewards.items()}
        return record

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out prompts, fixed noise, ODE sampler: training rewards, gold metrics, diversity."""
        s, e = self.config.sampling, self.config.eval
        prompts = self.test_prompts[: e.max_prompts] if e.max_prompts else self.test_prompts
        full = [p for p in prompts for _ in range(e.samples_per_prompt)]
        pad = (-len(full)) % self.accelerator.num_processes
        full_padded = full + full[:pad]
        local = self._local_slice(len(full_padded))
        sampler = "ode" if self.policy.adapter.time_kind == "flow" else "ddim"
        generator = seeded(e.seed, self.accelerator.process_index)
        self.model.eval()
        guidance = s.guidance_scale if e.guidance_scale is None else e.guidance_scale
        texts = [str(p) for p in full_padded[local]]
        with self.ema.swapped() if self.ema is not None else nullcontext(), self.accelerator.autocast():
            latents = self.evaluation_latents(texts, generator, s.height, s.width)
            rollout = self.policy.rollout(texts, num_steps=e.num_steps or s.num_steps, guidance_scale=guidance,
                                          noise_level=0.0, sampler=sampler, generator=generator, height=s.height,
                                          width=s.width, latents=latents)  # fmt: skip
        fns = {**self.reward_fns, **self.eval_fns}
        scores = {k: v[: len(full)] for k, v in self.score(rollout.images, full_padded[local], fns).items()}
        # diversity on (at most) 64x64 thumbnails, so gathering large images stays cheap
        thumbs = rollout.images.float()
        if thumbs.shape[-1] > 64:
            thumbs = torch.nn.functional.interpolate(thumbs, size=(64, 64), mode="area")
        images = self._gather(thumbs)[: len(full)]
        out = {f"eval/{name}": _nanmean(v) for name, v in scores.items()}
        out["eval/reward"] = _nanmean(self.combined_reward(scores))
        out["eval/diversity"] = _group_diversity(images, e.samples_per_prompt)
        return out

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    def train(self, resume: str | Path | bool | None = None) -> dict:
        """Run (or resume) training to `run.epochs`; returns the summary."""
        from tqdm.auto import tqdm

        cfg = self.config
        start_time = time.time()
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "images").mkdir(exist_ok=True)
            save_config(cfg, self.output_dir / "config.yaml")
        self.accelerator.wait_for_everyone()
        self.log = MetricsLog(self.output_dir / "metrics.jsonl")
        wall_before = 0.0
        if resume:
            path = checkpoint.latest(self.output_dir) if resume is True else Path(resume)
            wall_before = self.load_checkpoint(path)
            if self.is_main:
                self.log.rewrite()
        else:
            if self.is_main and self.log.path.exists():
                self.log.path.unlink()
        if self.accelerator.trackers == [] and cfg.run.log_with:
            self.accelerator.init_trackers("flowrl", config=_flat(cfg))
        if not self.eval_history:
            self._record_eval(0, self.evaluate())

        bar = tqdm(range(self.epoch, cfg.run.epochs), disable=not self.is_main, desc=cfg.trainer, unit="epoch")
        for epoch in bar:
            record = self.train_epoch(epoch)
            self.epoch = epoch + 1
            last = self.epoch == cfg.run.epochs
            if last or (cfg.eval.every and self.epoch % cfg.eval.every == 0):
                evaluation = self.evaluate()
                record.update(evaluation)
                self._record_eval(self.epoch, evaluation)
            record["wall_s"] = wall_before + time.time() - start_time
            self._log(record)
            if cfg.run.images_every and (self.epoch % cfg.run.images_every == 0 or self.epoch == 1):
                self._log_images()
            bar.set_postfix(reward=f"{scalar(record['reward/mean']):.3f}",
                            eval=f"{self.eval_history[-1].get('eval/reward', float('nan')):.3f}")  # fmt: skip
            if last or (cfg.run.save_every and self.epoch % cfg.run.save_every == 0):
                self.save_checkpoint(wall_before + time.time() - start_time)
        summary = self._summary(wall_before + time.time() - start_time)
        if self.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True))
            plot_curves(self.log.history, self.output_dir / "plots")
            print(_summary_screen(summary, self.output_dir))
        self.accelerator.end_training()
        return summary

    def _record_eval(self, epoch: int, evaluation: dict) -> None:
        self.eval_history.append({"epoch": epoch, **{k: scalar(v) for k, v in evaluation.items()}})

    def _log(self, record: dict) -> None:
        record = {k: scalar(v) for k, v in record.items()}
        if self.is_main:
            self.log.append(record)
        numbers = {k: v for k, v in record.items() if isinstance(v, float) and not math.isnan(v)}
        for key, values in record.items():
            if isinstance(values, list):
                numbers.update({f"{key}/step_{i}": v for i, v in enumerate(values)})
        if self.accelerator.trackers:
            self.accelerator.log(numbers, step=record["epoch"])

    def _log_images(self) -> None:
        if not self.is_main or getattr(self, "_last_rollout", None) is None:
            return
        rollout, k = self._last_rollout, self.config.prompts.group_size
        take = list(range(0, len(rollout), max(1, k // 2)))[:16]
        total = self.combined_reward(self._last_rewards)
        captions = [f"{rollout.prompts[i][:28]}\nr={total[i]:.3f}" for i in take]
        path = self.output_dir / "images" / f"epoch_{self.epoch:04d}.png"
        image_grid(rollout.images[take], captions, path, title=f"epoch {self.epoch}")
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_images("samples", rollout.images[take].float().clamp(0, 1), self.epoch)

    def _summary(self, wall_s: float) -> dict:
        first, last = self.eval_history[0], self.eval_history[-1]
        gold = self.config.eval.metrics[0] if self.config.eval.metrics else None
        metrics = [k for k in last if k != "epoch"]
        return {
            "trainer": self.config.trainer,
            "epochs": self.epoch,
            "wall_s": round(wall_s, 1),
            "reward_start": first.get("eval/reward"),
            "reward_end": last.get("eval/reward"),
            "gold_metric": gold,
            "gold_start": first.get(f"eval/{gold}") if gold else None,
            "gold_end": last.get(f"eval/{gold}") if gold else None,
            "eval_start": {k: first.get(k) for k in metrics},
            "eval_end": {k: last.get(k) for k in metrics},
            "eval_history": self.eval_history,
            "samples_scored": self.samples_scored,
            "train_reward_end": self.log.history[-1]["reward/mean"] if self.log.history else None,
        }

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """flowrl's own resumable state (JSON part, tensor part); subclasses extend it."""
        tensors = {f"ema.{i}": t for i, t in enumerate(self.ema.shadow)} if self.ema is not None else {}
        state = {"epoch": self.epoch, "optimizer_steps": self.optimizer_steps, "eval_history": self.eval_history,
                 "metrics": self.log.history if self.log else [], "trainer": self.config.trainer,
                 "samples_scored": self.samples_scored}  # fmt: skip
        return state, tensors

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        if state.get("trainer") != self.config.trainer:
            found, wanted = state.get("trainer"), self.config.trainer
            raise checkpoint.CheckpointError(f"checkpoint is from trainer {found!r}, not {wanted!r}")
        self.epoch, self.optimizer_steps = state["epoch"], state["optimizer_steps"]
        self.samples_scored = state.get("samples_scored", 0)
        self.eval_history = state["eval_history"]
        if self.log is not None:
            self.log.history = state["metrics"]
        if self.ema is not None:
            for i, shadow in enumerate(self.ema.shadow):
                shadow.copy_(tensors[f"ema.{i}"])

    def save_checkpoint(self, wall_s: float = 0.0) -> Path:
        state, tensors = self.state_dict()
        state["wall_s"] = wall_s
        folder = self.output_dir / "checkpoints" / f"epoch_{self.epoch}"
        return checkpoint.save(folder, self.accelerator, state, tensors, keep=self.config.run.keep_checkpoints)

    def load_checkpoint(self, path: str | Path) -> float:
        state, tensors = checkpoint.load(path, self.accelerator)
        self.load_state_dict(state, tensors)
        if self.is_main:
            print(f"resumed from {path} at epoch {self.epoch}")
        return float(state.get("wall_s", 0.0))


class EpochStats:
    """Accumulates per-micro-step metrics into epoch means and per-step ratio statistics."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.per_step: dict[int, list[float]] = {}

    def add_scalar(self, key: str, value) -> None:
        value = scalar(value)
        if isinstance(value, float) and math.isfinite(value):
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1

    def add(self, metrics: dict, loss, steps: torch.Tensor) -> None:
        self.add_scalar("loss", loss)
        for key, value in metrics.items():
            if key.startswith("_"):
                continue
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                continue
            self.add_scalar(key, value)
        # per denoising step: the ratio's mean and spread (GRPO-Guard's diagnostic), raw and as used
        for key in ("_ratio", "_raw_ratio"):
            if key in metrics:
                for step, r in zip(steps.tolist(), metrics[key].detach().float().flatten().tolist()):
                    self.per_step.setdefault((key, step), []).append(r)

    def summary(self) -> dict[str, Any]:
        out = {k: self.sums[k] / self.counts[k] for k in self.sums}
        for (key, step), values in sorted(self.per_step.items()):
            t = torch.tensor(values, dtype=torch.float64)
            name = "ratio" if key == "_ratio" else "raw_ratio"
            out[f"{name}_mean/step_{step}"] = float(t.mean())
            out[f"{name}_std/step_{step}"] = float(t.std(unbiased=False))
        return out


def _texts_and_metadata(prompts: list) -> tuple[list[str], dict[str, list]]:
    """Prompt texts and their metadata as per-sample lists (`Prompt` objects or plain strings)."""
    texts = [str(p) for p in prompts]
    keys = dict.fromkeys(k for p in prompts for k in getattr(p, "metadata", {}))
    return texts, {k: [getattr(p, "metadata", {}).get(k) for p in prompts] for k in keys}


def _informative_groups(group_ids: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Samples whose group has any non-zero advantage."""
    nonzero = torch.zeros(int(group_ids.max()) + 1).index_add_(0, group_ids[valid], (advantages[valid] != 0).float())
    return nonzero[group_ids] > 0


def _nanmean(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.mean()) if finite.numel() else float("nan")


def _group_diversity(images: torch.Tensor, k: int) -> float:
    """Mean pairwise RMS pixel distance within each group of k consecutive samples (0 = identical samples)."""
    if k < 2:
        return float("nan")
    groups = images[: len(images) // k * k].flatten(1).reshape(-1, k, images[0].numel())
    d = torch.cdist(groups, groups) / math.sqrt(images[0].numel())  # [G, k, k]
    return float(d.sum((1, 2)).mean() / (k * (k - 1)))


def _flat(config) -> dict:
    from flowrl.config import to_dict

    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, str, bool)):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    walk("", to_dict(config))
    return out


def _summary_screen(summary: dict, output_dir: Path) -> str:
    lines = [f"\n== {summary['trainer']}: {summary['epochs']} epochs in {summary['wall_s']:.0f} s ==",
             f"{'metric':<28}{'start':>10}{'end':>10}"]  # fmt: skip
    for key, start in summary["eval_start"].items():
        end = summary["eval_end"].get(key)
        fmt = lambda v: f"{v:10.4f}" if isinstance(v, float) else f"{v!s:>10}"  # noqa: E731
        lines.append(f"{key:<28}{fmt(start)}{fmt(end)}")
    lines.append(f"run folder: {output_dir}  (summary.json, metrics.jsonl, plots/, images/, checkpoints/)")
    return "\n".join(lines)
