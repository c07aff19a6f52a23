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

In flowrl's terms: the `advantage` estimator is `raw` (the value network is the baseline), the `objective` is
the core's `clamp`, the transitions are a view of the rollout (`DiffusionRollout.to_transitions`), and each
buffer minibatch goes through the shared `[b, K]` update with one element per transition (its step). The
KL is the released code's `kl.form: eps_mse` (unweighted MSE of the guided predictions, what beta 0.1 was
tuned for) or `gaussian` (the exact KL of the step kernels). docs/algorithms/dpok.md records what is
confirmed and what is chosen.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import ClassVar

import torch

from flowrl.config import (
    AdvantageConfig,
    KLConfig,
    ObjectiveConfig,
    OptimConfig,
    PromptConfig,
    StepConfig,
    TrainerConfig,
)
from flowrl.policies.diffusion import Transitions
from flowrl.policies.value import StateValueNet, pooled_text
from flowrl.trainers.image import STEP_KL_FORMS, ImageTrainer
from flowrl.trainers.registry import TRAINERS
from flowrl.trainers.state import seeded
from flowrl.trainers.update import EpochStats, Terms


@dataclasses.dataclass
class DPOKConfig(TrainerConfig):
    kl_forms: ClassVar[tuple[str, ...]] = STEP_KL_FORMS

    trainer: str = "dpok"
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="clamp", clip_eps_low=1e-4)
    )
    """The ratio clamp `[1 - eps, 1 + eps]`, eps 1e-4 (DPOK, for SD1.5's 16,384 latent elements)."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=lambda: AdvantageConfig(estimator="raw"))
    """The reward itself: the value network `V(x_t, t, c)` is DPOK's baseline (`use_value`)."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.1, form="eps_mse"))
    """beta 0.1 (multi-prompt; single prompt 0.01) on DPOK's code form `eps_mse`, the form that beta was tuned
    for: the exact step KL (`gaussian`) is `w_t` times it (median w_t 0.088 over SD1.5's 50 DDIM steps), so the
    same beta on `gaussian` is a ~10x weaker regulariser."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(selection="all"))
    """Every stochastic step of every sample goes into the buffer (DPOK)."""
    reward_weight: float = 1000.0
    """alpha, the weight of the policy-gradient term (DPOK multi-prompt: 1000; single prompt: 10)."""
    buffer_size: int = 1000
    """Replay-buffer capacity in single-step transitions, FIFO, shared by every process (DPOK: 1000)."""
    policy_steps: int = 5
    """Policy optimizer steps per epoch (DPOK's `p_step`: 5)."""
    policy_batch_size: int = 2
    """Buffer transitions per policy minibatch (per process: N processes draw one minibatch of N x this many);
    each optimizer step accumulates `optim.gradient_accumulation` minibatches (DPOK multi-prompt: 2 x 12; single
    prompt: 4 x 12)."""
    use_value: bool = True
    """Subtract the learned baseline `V(x_t, sigma_t, c)` from the reward (False: A = r, DPOK's `v_flag 0`)."""
    value_lr: float = 1e-4
    """AdamW learning rate of the value network (DPOK: 1e-4)."""
    value_steps: int = 5
    """Value minibatches accumulated into one value optimizer step (DPOK's `v_step`: 5)."""
    value_updates: int = 1
    """Value optimizer steps per epoch, each over `value_steps` fresh minibatches (DPOK: 1)."""
    value_batch_size: int = 256
    """Buffer transitions per value minibatch (per process, as `policy_batch_size`; DPOK: 256)."""
    value_hidden: int = 128
    """Width of the value network (`flowrl.policies.value.StateValueNet`)."""
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0, max_grad_norm=0.1, gradient_accumulation=12)
    )
    """Policy AdamW: DPOK's lr 1e-5, no weight decay, gradient-norm clip 0.1, 12 minibatches per step."""
    prompts: PromptConfig = dataclasses.field(default_factory=lambda: PromptConfig(prompts_per_epoch=6, group_size=1))
    """DPOK multi-prompt samples 6 prompts, one image each, per epoch (`g_batch_size 6`, `num_samples 1`)."""
    drop_zero_std_groups: bool = False
    """Must stay False: DPOK stores every valid transition (it has no group advantages)."""

    def __post_init__(self):
        super().__post_init__()
        checks = [
            (self.buffer_size >= 1, "buffer_size must be >= 1"),
            (self.policy_steps >= 1, "policy_steps must be >= 1"),
            (self.policy_batch_size >= 1, "policy_batch_size must be >= 1"),
            (self.value_steps >= 1, "value_steps must be >= 1"),
            (self.value_updates >= 1, "value_updates must be >= 1"),
            (self.value_batch_size >= 1, "value_batch_size must be >= 1"),
            (self.inner_epochs == 1, "dpok draws policy_steps random buffer minibatches; inner_epochs must be 1"),
            (not self.drop_zero_std_groups, "dpok stores every valid transition; drop_zero_std_groups must be false"),
            (self.reward_aggregation == "sum", "dpok learns the weighted reward sum (reward_aggregation: sum)"),
            (self.objective.name != "grpo_guard", "the replay buffer keeps no behaviour means for grpo_guard"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


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

    def sample(self, n: int, generator: torch.Generator) -> Transitions:
        """`min(n, len)` distinct random transitions (DPOK draws each minibatch without replacement)."""
        if self.data is None:
            raise ValueError("the replay buffer is empty")
        index = torch.randperm(len(self), generator=generator)[: min(n, len(self))]
        return self.data.select(index)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.data is None else self.data.state_dict()[1]

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.data = Transitions.from_state_dict({}, tensors) if tensors else None


@TRAINERS.register(
    "dpok",
    description="DPOK: clamped policy gradient from a replay buffer, value baseline, per-step KL (arXiv:2305.16381)",
)
class DPOKTrainer(ImageTrainer):
    """DPOK; see the module docstring and `DPOKConfig`."""

    config_class = DPOKConfig

    def setup(self) -> None:
        c = self.config
        self.buffer = ReplayBuffer(c.buffer_size)
        # transitions name their prompt by its index in this table (stable across epochs and resumes)
        self.prompt_table = list(dict.fromkeys(str(p) for p in self.train_prompts))
        self.prompt_index = {text: i for i, text in enumerate(self.prompt_table)}
        self.settings = None  # the current epoch's rollout: sampler settings and schedule for re-scoring
        self.value_net = None
        if c.use_value:
            text_dim = pooled_text(self.policy.encode(self.prompt_table[:1])).shape[-1]
            with torch.random.fork_rng(devices=[]):  # the same initial value net in every run of this seed
                torch.manual_seed(c.run.seed)
                self.value_net = StateValueNet(self.policy.model.config.in_channels, text_dim, hidden=c.value_hidden)

    def auxiliary_modules(self):
        return {"value": (self.value_net, self.config.value_lr)} if self.value_net is not None else {}

    # ------------------------------------------------------------------------------------------
    # buffer, value, policy
    # ------------------------------------------------------------------------------------------

    def transitions(self, rollout, returns: torch.Tensor, keep: torch.Tensor, epoch: int = 0) -> Transitions:
        """The trained steps (`steps`) of every kept sample, from every process, trajectory by trajectory.

        (DPOK appends step-major; trajectory order means that an epoch larger than the buffer loses whole
        trajectories rather than all its early steps.)
        """
        index = self.train_elements(rollout, epoch)  # [B, k]
        rows = torch.arange(len(rollout)).repeat_interleave(index.shape[1])
        local = rollout.to_transitions(rows, index.reshape(-1))
        table = torch.tensor([self.prompt_index[p] for p in rollout.unique_prompts])
        local = dataclasses.replace(local, prompts=table[local.prompts], rewards=returns[rows].float())
        kept = keep[rows]
        return Transitions(**{f: self.processes.gather_rows(getattr(local, f), kept)
                              for f in Transitions.per_sample_fields()})  # fmt: skip

    def conditioning(self, prompts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row conditioning `[n, ...]` of prompt indices (cached text embeddings)."""
        return self.policy.encode([self.prompt_table[i] for i in prompts.tolist()])

    def value(self, batch: Transitions) -> torch.Tensor:
        """`[n]` baseline `V(x_t, sigma_t, c)` of buffer transitions."""
        module, _ = self.aux["value"]
        device = self.accelerator.device
        sigmas = self.settings.sigmas.cpu()[batch.steps]
        text = pooled_text(self.conditioning(batch.prompts))
        return module(batch.states.to(device), sigmas.to(device), text.to(device))

    def update(self, rollout, advantages: torch.Tensor, trainable: torch.Tensor, epoch: int) -> dict:
        """Push the epoch's transitions, fit the value network, then `policy_steps` clamped-PG steps."""
        self.settings = rollout
        self.buffer.push(self.transitions(rollout, advantages, trainable, epoch))
        stats = EpochStats()
        stats.add_scalar("buffer_size", len(self.buffer), shared=True)  # every process holds the whole buffer
        # the same draws on every process (the trailing 0 keeps the stream one process always drew)
        if self.value_net is not None:
            self.update_value(seeded(self.config.run.seed, epoch, 20, 0), stats)
        self.update_policy(seeded(self.config.run.seed, epoch, 21, 0), stats)
        return stats.summary(self.processes)  # every process's equal shares, pooled

    def sample_share(self, per_process: int, generator: torch.Generator) -> Transitions:
        """This process's share of one buffer minibatch drawn for all processes (`per_process` rows each): every
        process holds the whole buffer and draws the same rows, so N processes train on what one process with
        N x `per_process` rows would."""
        world, rank = self.processes.world, self.processes.rank
        batch = self.buffer.sample(per_process * world, generator)
        share = len(batch) // world
        return batch if world == 1 else batch.select(torch.arange(rank * share, (rank + 1) * share))

    def update_value(self, generator: torch.Generator, stats: EpochStats) -> None:
        """`value_updates` optimizer steps, each on `value_steps` minibatches of MSE to the stored returns."""
        c = self.config
        module, optimizer = self.aux["value"]
        module.train()
        for _ in range(c.value_updates):
            for i in range(c.value_steps):
                batch = self.sample_share(c.value_batch_size, generator)
                sync = i == c.value_steps - 1
                with nullcontext() if sync else self.accelerator.no_sync(module):
                    prediction = self.value(batch)
                    loss = torch.nn.functional.mse_loss(prediction, batch.rewards.to(prediction.device))
                    self.accelerator.backward(loss / c.value_steps)
                stats.add_scalar("value_loss", loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def advantage(self, batch: Transitions) -> torch.Tensor:
        """`[n]` `r - V(x_t, t, c)` of buffer transitions (`r` without the value network)."""
        advantages = batch.rewards.to(self.accelerator.device)
        if self.value_net is not None:
            with torch.no_grad():
                advantages = advantages - self.value(batch).float()
        return advantages

    def update_policy(self, generator: torch.Generator, stats: EpochStats) -> None:
        """`policy_steps` optimizer steps, each over `optim.gradient_accumulation` random buffer minibatches
        of one element each (the transition's step): the shared `[b, K]` update."""
        c = self.config
        n = c.optim.gradient_accumulation
        self.model.train()
        for _ in range(c.policy_steps):
            for _ in range(n):
                batch = self.sample_share(c.policy_batch_size, generator)
                advantages = self.advantage(batch)
                stats.add_scalar("advantage_mean", advantages.mean())
                stats.add_scalar("advantage_abs", advantages.abs().mean())
                # -alpha A clamp(rho): alpha scales the advantage; the minibatches have equal size, so 1/n each
                # is the exact mean over the window
                index = batch.steps[:, None]
                stats.add(self.train_minibatch(batch, index, c.reward_weight * advantages, scale=1 / n))
            stats.add_scalar("grad_norm", self.optimizer_step(), shared=True)

    def num_elements(self, batch) -> int:
        return self.settings.num_steps if isinstance(batch, Transitions) else batch.num_steps

    def score(self, batch, index: torch.Tensor) -> Terms:
        """Buffer transitions (one element each: their step) re-scored against the current epoch's settings."""
        if not isinstance(batch, Transitions):
            return super().score(batch, index)
        device = self.accelerator.device
        terms = self.transition_terms(self.settings, batch.states.to(device), batch.next_states.to(device),
                                      batch.steps, self.conditioning(batch.prompts), batch.log_probs)  # fmt: skip
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
