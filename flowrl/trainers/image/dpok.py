"""DPOK (Fan et al., NeurIPS 2023, arXiv:2305.16381): online policy gradient with a KL to the pre-trained model.

DPOK minimises `E_c[-alpha E_{p_theta(x_0|c)} r(x_0, c) + beta sum_t E KL(p_theta(x_{t+1}|x_t, c) || p_pre(...))]`:
the reward, plus the per-step KL of the denoising kernels to the pre-trained ones, whose sum upper-bounds the
KL of the final images. As released (google-research/dpok `train_online_pg.py`), each epoch

1. samples images and pushes every single-step transition `(x_t, x_{t+1}, t, c, log p_old, r(x_0, c))` into a
   FIFO replay buffer of the last `buffer_size` transitions;
2. fits a value function `V(x_t, t, c)` to the final reward on random buffer transitions (MSE);
3. takes `policy_steps` optimizer steps, each on random buffer transitions, of the per-transition loss
   `-alpha A clamp(rho, 1 - eps, 1 + eps) + beta KL_t` with `A = r - V(x_t, t, c)` and
   `rho = p_theta(x_{t+1}|x_t) / p_old(x_{t+1}|x_t)`: the **clamp** (not PPO's min) passes gradient only while
   `rho` lies inside the band, for either sign of A, so stale transitions contribute only their KL.

In flowrl's terms: the `advantage` estimator is `raw` (the value network, `critic`, is the baseline), the
`objective` is the core's `clamp`, the transitions are a view of the rollout (`DiffusionRollout.to_transitions`),
and each of the `policy_steps` optimizer steps trains one draw of `batch.mini_batch_size` buffer transitions
(every process holds the buffer and trains its share of the draw) through the shared update scheduler, with one
element per transition (its step). The KL is the released code's `kl.form: eps_mse` (unweighted MSE of the guided
predictions, what beta 0.1 was tuned for) or `gaussian` (the exact KL of the step kernels).
docs/algorithms/dpok.md records what is confirmed and what is chosen.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from flowrl.core.terms import Terms
from flowrl.image import HasSteps, ImageConfig, StepConfig
from flowrl.image.steps import STEP_KL_FORMS
from flowrl.policies.diffusion import Transitions
from flowrl.policies.value import StateValueNet, pooled_text
from flowrl.run.registry import register
from flowrl.run.scheduler import UpdateBatch
from flowrl.runtime import seeded
from flowrl.sections import (
    AdvantageConfig,
    BatchConfig,
    HasKL,
    HasObjective,
    KLConfig,
    ObjectiveConfig,
    OptimConfig,
    PromptConfig,
)
from flowrl.trainers.shared.image import ImageAlgorithm


@dataclasses.dataclass
class ValueCriticConfig:
    """DPOK's value network `V(x_t, sigma_t, c)`, trained on random buffer transitions each epoch."""

    enabled: bool = True
    """Subtract the learned baseline from the reward (False: A = r, DPOK's `v_flag 0`)."""
    lr: float = 1e-4
    """AdamW learning rate (DPOK: 1e-4)."""
    steps: int = 1
    """Optimizer steps per epoch, each on a fresh draw of `mini_batch_size` transitions (DPOK: 1)."""
    mini_batch_size: int = 1280
    """Buffer transitions per step, over every process (DPOK: 5 minibatches of 256 accumulated)."""
    hidden: int = 128
    """Width of the network (`flowrl.policies.value.StateValueNet`)."""


@dataclasses.dataclass
class DPOKConfig(HasObjective, HasKL, HasSteps, ImageConfig):
    kl_forms: ClassVar[tuple[str, ...]] = STEP_KL_FORMS
    absent: ClassVar[dict[str, str]] = {
        "drop_zero_std_groups": "dpok stores every valid transition in its replay buffer (it has no group advantages)"
    }
    renamed: ClassVar[dict[str, str]] = {
        "policy_batch_size": "batch.mini_batch_size (transitions per optimizer step over every process: the old "
        "policy_batch_size x gradient_accumulation x processes) and batch.micro_batch_size",
        "use_value": "critic.enabled",
        "value_lr": "critic.lr",
        "value_hidden": "critic.hidden",
        "value_updates": "critic.steps",
        "value_steps": "critic.mini_batch_size (transitions per critic step: the old value_steps x value_batch_size)",
        "value_batch_size": "critic.mini_batch_size (transitions per critic step: the old value_steps x "
        "value_batch_size)",
    }

    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="clamp", clip_eps_low=1e-4)
    )
    """The ratio clamp `[1 - eps, 1 + eps]`, eps 1e-4 (DPOK, for SD1.5's 16,384 latent elements)."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=lambda: AdvantageConfig(estimator="raw"))
    """The reward itself: the value network `V(x_t, t, c)` is DPOK's baseline (`critic`)."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.1, form="eps_mse"))
    """beta 0.1 (multi-prompt; single prompt 0.01) on DPOK's code form `eps_mse`, the form that beta was tuned
    for: the exact step KL (`gaussian`) is `w_t` times it (median w_t 0.088 over SD1.5's 50 DDIM steps), so the
    same beta on `gaussian` is a ~10x weaker regulariser."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(selection="all"))
    """Every stochastic step of every sample goes into the buffer (DPOK)."""
    batch: BatchConfig = dataclasses.field(default_factory=lambda: BatchConfig(mini_batch_size=24, micro_batch_size=2))
    """Each policy step trains 24 buffer transitions, 2 per call (DPOK multi-prompt: 12 accumulated minibatches of
    2; single prompt: of 4)."""
    critic: ValueCriticConfig = dataclasses.field(default_factory=ValueCriticConfig)
    """The value network."""
    reward_weight: float = 1000.0
    """alpha, the weight of the policy-gradient term (DPOK multi-prompt: 1000; single prompt: 10)."""
    buffer_size: int = 1000
    """Replay-buffer capacity in single-step transitions, FIFO, shared by every process (DPOK: 1000)."""
    policy_steps: int = 5
    """Policy optimizer steps per epoch, each on a fresh draw of `batch.mini_batch_size` transitions (DPOK's
    `p_step`: 5)."""
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0, max_grad_norm=0.1)
    )
    """Policy AdamW: DPOK's lr 1e-5, no weight decay, gradient-norm clip 0.1."""
    prompts: PromptConfig = dataclasses.field(default_factory=lambda: PromptConfig(prompts_per_epoch=6, group_size=1))
    """DPOK multi-prompt samples 6 prompts, one image each, per epoch (`g_batch_size 6`, `num_samples 1`)."""

    def checks(self):
        c = self.critic
        return [
            *super().checks(),
            (self.buffer_size >= 1, "buffer_size must be >= 1"),
            (self.policy_steps >= 1, "policy_steps must be >= 1"),
            (self.batch.mini_batch_size is not None, "dpok draws batch.mini_batch_size transitions per step: set it"),
            (c.steps >= 1 and c.mini_batch_size >= 1, "critic.steps and critic.mini_batch_size must be >= 1"),
            (
                self.batch.inner_epochs == 1,
                "dpok draws policy_steps random buffer batches; batch.inner_epochs must be 1",
            ),
            (self.reward_aggregation == "sum", "dpok learns the weighted reward sum (reward_aggregation: sum)"),
            (self.objective.name != "grpo_guard", "the replay buffer keeps no behaviour means for grpo_guard"),
        ]


class ReplayBuffer:
    """A FIFO of single-step transitions on the CPU that keeps the most recent `capacity` (DPOK's buffer).

    Args:
        capacity (`int`): how many transitions to keep; pushing more drops the oldest first.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.data: Transitions | None = None

    def __len__(self) -> int:
        return 0 if self.data is None else len(self.data)

    def push(self, transitions: Transitions) -> None:
        """Append `transitions` (oldest first) and drop the oldest beyond the capacity."""
        cpu = transitions.to("cpu")
        data = cpu if self.data is None else Transitions.cat([self.data, cpu])
        self.data = data.select(slice(max(0, len(data) - self.capacity), None))

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """`min(n, len)` distinct random rows (DPOK draws each minibatch without replacement)."""
        if self.data is None:
            raise ValueError("the replay buffer is empty")
        return torch.randperm(len(self), generator=generator)[: min(n, len(self))]

    def sample(self, n: int, generator: torch.Generator) -> Transitions:
        """The transitions of `draw(n, generator)`."""
        rows = self.draw(n, generator)
        return self.data.select(rows)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.data is None else self.data.state_dict()[1]

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.data = Transitions.from_state_dict({}, tensors) if tensors else None


@register(
    "dpok",
    description="DPOK: clamped policy gradient from a replay buffer, value baseline, per-step KL (arXiv:2305.16381)",
)
class DPOK(ImageAlgorithm):
    """DPOK; see the module docstring and `DPOKConfig`."""

    config_class = DPOKConfig
    edits = False  # its conditioning is the prompt text only
    video = False  # the value net is a 2-D conv net over image latents

    def build(self) -> None:
        c = self.config
        self.buffer = ReplayBuffer(c.buffer_size)
        # transitions name their prompt by its index in this table (stable across epochs and resumes)
        self.prompt_table = list(dict.fromkeys(str(p) for p in self.modality.train_prompts))
        self.prompt_index = {text: i for i, text in enumerate(self.prompt_table)}
        self.settings = None  # the current epoch's rollout: sampler settings and schedule for re-scoring
        self.value_net = None
        if c.critic.enabled:
            text_dim = pooled_text(self.policy.encode(self.prompt_table[:1])).shape[-1]
            with torch.random.fork_rng(devices=[]):  # the same initial value net in every run of this seed
                torch.manual_seed(c.run.seed)
                self.value_net = StateValueNet(self.policy.model.config.in_channels, text_dim, hidden=c.critic.hidden)

    def auxiliary_modules(self):
        return {"value": (self.value_net, self.config.critic.lr)} if self.value_net is not None else {}

    # ------------------------------------------------------------------------------------------
    # buffer, value, policy
    # ------------------------------------------------------------------------------------------

    def transitions(self, collected, returns: torch.Tensor, keep: torch.Tensor, epoch: int) -> Transitions:
        """The trained steps (`steps`) of every kept sample, from every process, trajectory by trajectory.

        (DPOK appends step-major; trajectory order means that an epoch larger than the buffer loses whole
        trajectories rather than all its early steps.)
        """
        rollout = collected.data
        index = self.step_terms.select(rollout, collected.rows, collected.size, epoch)  # [B, k]
        rows = torch.arange(len(rollout)).repeat_interleave(index.shape[1])
        local = rollout.to_transitions(rows, index.reshape(-1))
        table = torch.tensor([self.prompt_index[p] for p in rollout.unique_prompts])
        local = dataclasses.replace(local, prompts=table[local.prompts], rewards=returns[collected.rows][rows].float())
        kept = keep[collected.rows][rows]
        return Transitions(
            **{f: self.processes.gather_rows(getattr(local, f), kept) for f in Transitions.per_sample_fields()}
        )

    def conditioning(self, prompts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row conditioning `[n, ...]` of prompt indices (cached text embeddings)."""
        return self.policy.encode([self.prompt_table[i] for i in prompts.tolist()])

    def value(self, batch: Transitions) -> torch.Tensor:
        """`[n]` baseline `V(x_t, sigma_t, c)` of buffer transitions."""
        device = self.engine.device
        sigmas = self.settings.sigmas.cpu()[batch.steps]
        text = pooled_text(self.conditioning(batch.prompts))
        return self.engine.aux_module("value")(batch.states.to(device), sigmas.to(device), text.to(device))

    def prepare(self, collected, advantages, trainable, epoch):
        """Push the epoch's transitions, fit the value network, then draw `policy_steps` batches of the buffer with
        their advantages `alpha (r - V(x_t, t, c))`."""
        c = self.config
        self.settings = collected.data
        self.buffer.push(self.transitions(collected, advantages, trainable, epoch))
        stats = {"buffer_size": len(self.buffer)}  # every process holds the whole buffer
        data = self.buffer.data
        if self.value_net is not None:
            stats["value_loss"] = self.fit_value(seeded(c.run.seed, epoch, 20, 0))
        adv = data.rewards.float()
        if self.value_net is not None:
            with torch.no_grad():
                size = c.batch.micro_batch_size
                adv = adv - torch.cat(
                    [self.value(data.select(slice(i, i + size))).float().cpu() for i in range(0, len(data), size)]
                )
        adv = c.reward_weight * adv
        generator = seeded(c.run.seed, epoch, 21, 0)  # the same draws on every process
        draws = [self.buffer.draw(c.batch.mini_batch_size, generator) for _ in range(c.policy_steps)]
        drawn = adv[torch.cat(draws)]
        stats.update({"advantage_mean": drawn.mean(), "advantage_abs": drawn.abs().mean()})
        batch = UpdateBatch(
            data=data,
            rows=None,
            size=len(data),
            advantages=adv,
            trainable=torch.ones(len(data), dtype=torch.bool),
            mini_batches=draws,
        )
        return batch, stats

    def fit_value(self, generator: torch.Generator) -> float:
        """`critic.steps` optimizer steps of the MSE to the stored returns, each on this process's share of a draw
        of `critic.mini_batch_size` transitions (the mean over the draw: the one-process step); the mean loss."""
        critic = self.config.critic
        module = self.engine.aux_module("value")
        module.train()
        world, rank = self.processes.world, self.processes.rank
        losses = []
        for _ in range(critic.steps):
            rows = self.buffer.draw(critic.mini_batch_size, generator)
            n = len(rows)
            share = self.buffer.data.select(rows[rank * n // world : (rank + 1) * n // world])
            prediction = self.value(share)
            error = (prediction - share.rewards.to(prediction.device)).square().sum()
            self.engine.aux_step("value", error / n)  # this process's share of the draw's mean
            losses.append(self.processes.sum(float(error.detach())) / n)
        module.eval()
        return sum(losses) / len(losses)

    def num_elements(self, data) -> int:
        return self.settings.num_steps if isinstance(data, Transitions) else data.num_steps

    def elements(self, batch, epoch):
        """One element per buffer transition: its step."""
        return batch.data.steps[:, None], None

    def terms(self, batch, index: torch.Tensor) -> Terms:
        """Buffer transitions (one element each: their step) re-scored against the current epoch's settings."""
        data, device = batch.data, self.engine.device
        terms = self.step_terms.transition_terms(
            self.settings,
            data.states.to(device),
            data.next_states.to(device),
            data.steps,
            self.conditioning(data.prompts),
            data.log_probs,
            self.epoch,
        )
        return Terms.from_tensors({k: v[:, None] for k, v in terms.tensors().items()})

    # ------------------------------------------------------------------------------------------
    # checkpoints: the buffer is resumable state (the value network and its optimizer are accelerate's)
    # ------------------------------------------------------------------------------------------

    def state_dict(self):
        state, tensors = super().state_dict()
        tensors.update({f"buffer.{k}": v for k, v in self.buffer.state_dict().items()})
        return state, tensors

    def load_state_dict(self, state, tensors):
        super().load_state_dict(state, tensors)
        self.buffer.load_state_dict({k[len("buffer.") :]: v for k, v in tensors.items() if k.startswith("buffer.")})
