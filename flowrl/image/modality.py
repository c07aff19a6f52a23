"""The image modality of a run: its policy, rewards and prompt sets, and the collector and evaluator it builds.

`ImageModality(config, context)` loads what an image run needs from its config (the digits world or a diffusers
pipeline, with LoRA or full fine-tuning; the training rewards and gold metrics; the prompt sets, checked against the
rewards before any model loads) and builds the modality's parts for an algorithm: `sampler` (one sampling call),
`collector` (an epoch of images and rewards), `evaluator` (held-out prompts, fixed noise). `flowrl sample` and
`flowrl eval` build one without a trainer.
"""

from __future__ import annotations

import torch

from flowrl import prompts as prompt_sets
from flowrl import rewards as reward_registry
from flowrl.image.collect import ImageCollector
from flowrl.image.config import ImageConfig
from flowrl.image.evaluate import ImageEvaluator, sample_grid
from flowrl.image.sampler import ImageSampler
from flowrl.models import ModelConfig
from flowrl.policies.build import encode_then_offload, load_policy, offloads_text, prepare_training
from flowrl.rewards import Rewards
from flowrl.rewards.scoring import reward_summary
from flowrl.runtime import RunContext
from flowrl.tracking import add_samples


def build_rewards(specs) -> dict:
    """`{name: reward}` of a config's `rewards` list (registered names or `package.module:attribute`)."""
    return {spec.name: reward_registry.get(spec.name, **spec.kwargs) for spec in specs}


def build_image_policy(
    model: ModelConfig,
    *,
    forward_batch_size: int,
    device="cpu",
    log=print,
    seed: int = 0,
    mixed_precision: str = "no",
    weights: bool = True,
    prompts=None,
):
    """The `DiffusionPolicy` of a `model` section, set up for training (LoRA or every weight, a LoRA initialised from
    `seed`): the digits world (built into the cache on first use) or a diffusers pipeline of a registered family.

    With `prompts` (every prompt the run will see) and text encoders kept in CPU memory (`offload_text_encoders`),
    the prompts are encoded first, with only the text encoders on the device, and the trained network moves to the
    device after: a network and text encoders that do not fit on the GPU together still load (FLUX.2-dev).
    `weights=False` builds the real-size networks without weights (`flowrl plan`)."""
    if model.name == "digits":
        from flowrl.digits import BuildConfig, load_world

        world = load_world(BuildConfig(pretrain_steps=model.digits_pretrain_steps), log=log)
        policy = world.policy(forward_batch_size=forward_batch_size)
        policy.model.to(device if weights else "meta")
    elif weights and model.offload_text_encoders is not False and torch.device(device).type != "cpu":
        policy = load_policy(model, forward_batch_size=forward_batch_size, device="cpu")
        if offloads_text(model, policy, device):  # the prompts encoded first, the trained network in CPU memory
            encode_then_offload(policy, device, prompts)
        policy.to_device(device)
    elif not weights:  # a plan of a GPU run: the text encoders are offloaded where the run would offload them
        policy = load_policy(model, forward_batch_size=forward_batch_size, weights=False)
        policy.text_encoders_offloaded = offloads_text(model, policy, "cuda")
    else:
        policy = load_policy(model, forward_batch_size=forward_batch_size, device=device)
        if model.offload_text_encoders is True:
            encode_then_offload(policy, device, prompts)
    return prepare_training(policy, model, seed=seed, mixed_precision=mixed_precision)


class ImageModality:
    """See the module docstring.

    Args:
        config (`ImageConfig`): the run's config.
        context (`RunContext`): processes, device, mixed precision, the log.
        policy (`DiffusionPolicy`, *optional*): use this policy instead of loading `config.model`.
        reward_fns, eval_fns (`dict`, *optional*): the training rewards and gold metrics by name (default: built
            from `config.rewards` and `config.eval.metrics`).
        memory (`PeakMemory`, *optional*): measures the collection's phases.
        scoring (`bool`): build the rewards and gold metrics (False: a policy that only samples; `flowrl sample`).
    """

    budget_key = "reward_evals"
    """The metrics row's count of samples scored so far (the run's reward budget)."""

    def __init__(
        self,
        config: ImageConfig,
        context: RunContext,
        *,
        policy=None,
        reward_fns: dict | None = None,
        eval_fns: dict | None = None,
        memory=None,
        scoring: bool = True,
    ):
        self.config, self.context, self.memory = config, context, memory
        self.train_prompts = prompt_sets.load(config.prompts.train)
        self.test_prompts = prompt_sets.load(config.prompts.test)
        self.val_prompts = prompt_sets.load(config.prompts.val) if config.prompts.val else []
        self.rewards, self.eval_fns = None, {}
        if scoring:  # rewards and data first: a bad reward name or prompt fails before any model is loaded
            reward_fns = build_rewards(config.rewards) if reward_fns is None else reward_fns
            eval_fns = {n: reward_registry.get(n) for n in config.eval.metrics} if eval_fns is None else eval_fns
            weights = {spec.name: spec.weight for spec in config.rewards}
            self.rewards = Rewards(reward_fns, weights, context.processes, config.run.max_bad_reward_frac)
            self.eval_fns = eval_fns
            self.check_inputs()
        if policy is None:
            policy = build_image_policy(
                config.model,
                forward_batch_size=config.batch.micro_batch_size,
                device=context.device,
                log=context.log,
                seed=config.run.seed,
                mixed_precision=config.run.mixed_precision,
                prompts=self.train_prompts + self.test_prompts + self.val_prompts,
            )
        policy.uncond_grad = config.sampling.uncond_grad
        self.policy = policy

    def check_inputs(self) -> None:
        """Every reward (and gold metric) that can judge prompts up front checks the train and test sets."""
        if not self.train_prompts or not self.test_prompts:
            raise ValueError("the training or test prompt set is empty")
        for name, fn in {**self.rewards.fns, **self.eval_fns}.items():
            check = getattr(fn, "check_prompts", None)
            if check is not None:
                sets = [("prompts.train", self.train_prompts), ("prompts.test", self.test_prompts)]
                sets.append(("prompts.val", self.val_prompts))
                for label, prompts in sets:
                    try:
                        check([str(p) for p in prompts])
                    except ValueError as err:
                        raise ValueError(f"{label} does not suit reward {name!r}: {err}") from None

    def ensure_reference(self, offload: bool = False) -> None:
        """A frozen reference for a KL: the network with LoRA disabled, or (full fine-tuning) a frozen copy."""
        if not (self.policy.has_lora or self.policy.reference_model is not None):
            self.policy.freeze_reference(offload=offload)

    # ------------------------------------------------------------------------------------------
    # the parts
    # ------------------------------------------------------------------------------------------

    def sampler(self, *, store_means: bool = False, requires_stochastic: bool = True) -> ImageSampler:
        c = self.config
        return ImageSampler(
            self.policy,
            c.sampling,
            seed=c.run.seed,
            group_size=c.prompts.group_size,
            autocast=self.context.autocast,
            store_means=store_means,
            requires_stochastic=requires_stochastic,
        )

    def collector(self, sampler) -> ImageCollector:
        c = self.config
        return ImageCollector(
            sampler=sampler,
            rewards=self.rewards,
            processes=self.context.processes,
            train_prompts=self.train_prompts,
            prompts_per_epoch=c.prompts.prompts_per_epoch,
            group_size=c.prompts.group_size,
            seed=c.run.seed,
            reward_overlap=c.sampling.reward_overlap,
            memory=self.memory,
        )

    def evaluator(self, initial_latents=None) -> ImageEvaluator:
        return ImageEvaluator(
            policy=self.policy,
            rewards=self.rewards,
            metrics=self.eval_fns,
            processes=self.context.processes,
            test_prompts=self.test_prompts,
            eval_config=self.config.eval,
            sampling=self.config.sampling,
            initial_latents=initial_latents,
            autocast=self.context.autocast,
            val_prompts=self.val_prompts,
        )

    # ------------------------------------------------------------------------------------------
    # an epoch's record and samples
    # ------------------------------------------------------------------------------------------

    def check(self, collected) -> tuple[torch.Tensor, dict]:
        """`(valid [N], record)`: the samples with finite rewards (too many bad ones abort the run) and the epoch's
        reward statistics."""
        valid, bad = self.rewards.check(collected.rewards)
        return valid, {**reward_summary(collected.rewards, collected.total, valid), **bad}

    def log_samples(self, collected, folder, epoch: int, trackers=()) -> None:
        """A grid of the epoch's samples (this process's) captioned with prompt and reward (`images/epoch_N.png`)."""
        rollout = collected.data
        total = collected.total[collected.rows]
        path = folder / "images" / f"epoch_{epoch:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        images = sample_grid(rollout, total, self.config.prompts.group_size, path, title=f"epoch {epoch}")
        for tracker in trackers:
            if tracker.name == "tensorboard":  # small images (the digits' 8x8) upscaled; videos as videos
                add_samples(tracker.writer, "samples", images, epoch)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The modality's resumable tensors (images keep none: an epoch depends only on the weights and seeds)."""
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Nothing to restore (see `state_dict`)."""
