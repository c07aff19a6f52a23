"""TempFlow-GRPO: trajectory branching and noise-aware step weights (He et al. 2025, arXiv:2508.04324).

Flow-GRPO gives every step of a trajectory the same terminal advantage. TempFlow-GRPO gives each step its own:
per prompt, `seeds_per_prompt` (N) initial noises each follow the deterministic ODE trunk; at every branch
step j (the steps `steps.selection` picks, Flow-GRPO's first 99%: 9 of 10), `branches` (K) flow-SDE samples
`x'_{j,k} ~ N(mu(x_j), s_j^2)` leave the trunk and are completed by the ODE, decoded and scored. Row (n, k, j)
trains only its branching transition `x_j -> x'_{j,k}`, with the advantage of its column

    A_{n,k,j} = (R_{n,k,j} - mean_{n',k'} R_{n',k',j}) / (std + 1e-4)   (per prompt and branch step; `group_keys`),

and PPO-clip weighted by the noise-aware `c s_j` (eq. 7): `s_j = sqrt(t_j / (1 - t_j)) sqrt(t_j - t_{j+1})`, `c`
scaling the weights to mean 1 over the branch steps (`steps.weighting: noise_aware`; SD3.5's 10 shift-3 steps:
1.58 ... 0.51). A prompt's group is `N x K x J` samples, laid out seed-major (sample i: seed `i // (K J)`,
step `(i // K) % J`, branch `i % K`); all samples of a seed start from one noise (`group_noise`).

flowrl samples each branch as a whole trajectory with a one-step SDE window `[j, j + 1)` from the seed's noise:
the ODE prefix is recomputed per branch instead of shared (the same samples at O(T) instead of O(T / 2) steps
per branch: the authors' `(9 + 8 + ... + 1) N K` steps become `10 x 9 N K`).
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.core import select_steps
from flowrl.core.copies import to_device
from flowrl.image import SamplingConfig, StepConfig
from flowrl.image.sampler import ImageSampler
from flowrl.image.steps import StepTerms
from flowrl.policies.diffusion import DiffusionRollout
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


BRANCH_SELECTIONS = ("all", "first_fraction", "window")


@dataclasses.dataclass
class TempFlowGRPOConfig(FlowGRPOConfig):
    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(sampler="flow_sde", noise_level=0.7)
    )
    """Flow-SDE branches (a = 0.7, hard-coded in the authors' SD3 code), ODE trunk and completions."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="group", eps=1e-4, clip=5.0, unbiased=False)
    )
    """Per prompt and branch step: mean and population std + 1e-4 (`global_std=False`), clipped to +-5."""
    steps: StepConfig = dataclasses.field(
        default_factory=lambda: StepConfig(
            selection="first_fraction", fraction=0.99, weighting="noise_aware", normalize_weights=True
        )
    )
    """Branch steps: the first 99% (9 of 10); noise-aware weights `c s_j` scaled to mean 1 over them."""
    seeds_per_prompt: int = 4
    """N, initial noises per prompt, each with its ODE trunk (the authors: 4)."""
    branches: int = 6
    """K, SDE samples leaving a trunk at each branch step (the authors: 6)."""

    def branch_steps(self) -> list[int]:
        """The steps j where trajectories branch (`steps.selection` over the T steps)."""
        s, t = self.steps, self.sampling.num_steps
        kwargs = {"all": {}, "first_fraction": {"fraction": s.fraction}}.get(s.selection)
        if s.selection == "window":
            start, end = s.window or (0, t)
            kwargs = {"start": start, "end": end}
        return select_steps(s.selection, t, 1, **kwargs)[0].tolist()

    def checks(self):
        checks = [
            *super().checks(),
            (self.steps.selection in BRANCH_SELECTIONS,
             f"tempflow_grpo branches at fixed steps: steps.selection must be one of {', '.join(BRANCH_SELECTIONS)}, "
             f"not {self.steps.selection!r}"),
            (self.seeds_per_prompt >= 1 and self.branches >= 1, "seeds_per_prompt and branches must be >= 1"),
            (self.sampling.sde_window is None and self.sampling.sde_window_schedule == "fixed",
             "tempflow_grpo sets each sample's SDE step itself: leave sampling.sde_window and its schedule unset"),
        ]  # fmt: skip
        if self.steps.selection in BRANCH_SELECTIONS:
            size = self.seeds_per_prompt * self.branches * len(self.branch_steps())
            checks.append(
                (
                    self.prompts.group_size == size,
                    f"prompts.group_size must be seeds_per_prompt x branches x branch steps = "
                    f"{self.seeds_per_prompt} x {self.branches} x {len(self.branch_steps())} = {size}, "
                    f"got {self.prompts.group_size}",
                )
            )
        return checks


class BranchingSampler(ImageSampler):
    """Each branch step's samples as trajectories stochastic only at that step, from their seed's noise."""

    def __init__(self, base: ImageSampler, config: TempFlowGRPOConfig, branch_of):
        super().__init__(
            base.policy,
            base.sampling,
            seed=base.seed,
            group_size=base.group_size,
            autocast=base.autocast,
            store_means=base.store_means,
        )
        self.config, self.branch_of = config, branch_of

    def __call__(self, texts, generators, rows, epoch):
        s = self.sampling
        latents = self.group_noise(rows, epoch, per_group=self.config.seeds_per_prompt)
        steps = torch.tensor([self.branch_of(r)[1] for r in rows])
        parts, order = [], []
        for j in steps.unique().tolist():
            mine = (steps == j).nonzero().flatten()
            with self.autocast():
                part = self.policy.rollout(
                    [texts[i] for i in mine],
                    num_steps=s.num_steps,
                    guidance_scale=s.guidance_scale,
                    noise_level=s.noise_level,
                    sampler=s.sampler,
                    sde_window=(j, j + 1),
                    latents=latents[to_device(mine, latents.device)],
                    generator=[generators[i] for i in mine],
                    height=s.height,
                    width=s.width,
                    store_means=self.store_means,
                )
            if not part.sde_mask[j]:
                raise ValueError(f"sampler {s.sampler!r} (noise_level {s.noise_level}) is deterministic at step {j}")
            parts.append(dataclasses.replace(part, stochastic_step=torch.full((len(mine),), j)))
            order.append(mine)
        union = torch.stack([p.sde_mask for p in parts]).any(0)
        stds = torch.stack([p.stds for p in parts]).amax(0)
        rollout = DiffusionRollout.cat([dataclasses.replace(p, sde_mask=union, stds=stds) for p in parts])
        return rollout.select(torch.argsort(torch.cat(order)))  # back to the order of `texts`


class BranchStepTerms(StepTerms):
    """Step terms whose `normalize_weights` scales the weights to mean 1 over the branch steps (TempFlow's `c`)."""

    def __init__(self, base: StepTerms, branch_steps: list[int]):
        super().__init__(base.policy, base.steps, base.kl, store_means=base.store_means, seed=base.seed)
        self.branch_steps = branch_steps

    def trainable_steps(self, rollout) -> torch.Tensor:
        return torch.as_tensor(self.branch_steps)


@register(
    "tempflow_grpo", description="TempFlow-GRPO: per-step advantages by branching, noise-aware weights (2508.04324)"
)
class TempFlowGRPO(FlowGRPO):
    """TempFlow-GRPO; see the module docstring and `TempFlowGRPOConfig`."""

    config_class = TempFlowGRPOConfig
    edits = False  # its branching sampler takes no source images
    time_kinds = ("flow",)  # flow-SDE branches

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        self.branch_steps = config.branch_steps()
        self.step_terms = BranchStepTerms(self.step_terms, self.branch_steps)

    def branch_of(self, position: int) -> tuple[int, int, int]:
        """`(seed n, branch step j, branch k)` of the sample at `position` in the epoch's prompt list."""
        c = self.config
        k, steps = c.branches, len(self.branch_steps)
        i = position % c.prompts.group_size
        return i // (k * steps), self.branch_steps[(i // k) % steps], i % k

    def group_keys(self, texts):
        """A baseline per prompt and branch step (the column's advantages have zero mean)."""
        return [(text, self.branch_of(i)[1]) for i, text in enumerate(texts)]

    def sampler(self):
        return BranchingSampler(super().sampler(), self.config, self.branch_of)

    def elements(self, batch, epoch):
        """`[B, 1]`: each sample trains its branching step."""
        return batch.data.stochastic_step[:, None], None
