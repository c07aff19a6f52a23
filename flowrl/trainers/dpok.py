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

The KL is the exact Gaussian KL of the step kernels (`kl_form: gaussian`) or the released code's unweighted
MSE of the (guided) network predictions (`kl_form: eps_mse`). docs/algorithms/dpok.md records what is
confirmed and what is chosen.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Literal

import torch

from flowrl.config import OptimConfig, PromptConfig
from flowrl.core import compute_policy_loss, gaussian_mean_kl
from flowrl.core.ratios import reduce_elements
from flowrl.policies.sde import StepOutput
from flowrl.policies.value import StateValueNet, pooled_text
from flowrl.trainers.base import EpochStats, Trainer, TrainerConfig, seeded
from flowrl.trainers.registry import TRAINERS


@dataclasses.dataclass
class DPOKConfig(TrainerConfig):
    trainer: str = "dpok"
    reward_weight: float = 1000.0
    """alpha, the weight of the policy-gradient term (DPOK multi-prompt: 1000; single prompt: 10)."""
    kl_weight: float = 0.1
    """beta, the weight of the per-step KL to the pre-trained model (multi-prompt: 0.1; single prompt: 0.01)."""
    kl_form: Literal["gaussian", "eps_mse"] = "gaussian"
    """`gaussian`: the exact KL of the step kernels; `eps_mse`: DPOK's code, the mean squared difference of the
    guided network predictions (noise for UNets, velocity for flow models), which drops the per-step weight."""
    kl_warmup: int = 0
    """Epochs trained without the KL before it applies (0: from the start; DPOK's `kl_warmup` k is k + 1 here)."""
    clip_eps: float = 1e-4
    """Half-width of the ratio clamp `[1 - eps, 1 + eps]` (DPOK: 1e-4 for SD1.5's 16,384 latent elements)."""
    buffer_size: int = 1000
    """Replay-buffer capacity in single-step transitions, FIFO, shared by every process (DPOK: 1000)."""
    policy_steps: int = 5
    """Policy optimizer steps per epoch (DPOK's `p_step`: 5)."""
    policy_batch_size: int = 2
    """Buffer transitions per policy minibatch; each optimizer step accumulates `optim.gradient_accumulation`
    minibatches (DPOK multi-prompt: 2 x 12; single prompt: 4 x 12)."""
    use_value: bool = True
    """Subtract the learned baseline `V(x_t, sigma_t, c)` from the reward (False: A = r, DPOK's `v_flag 0`)."""
    value_lr: float = 1e-4
    """AdamW learning rate of the value network (DPOK: 1e-4)."""
    value_steps: int = 5
    """Value minibatches accumulated into one value optimizer step (DPOK's `v_step`: 5)."""
    value_updates: int = 1
    """Value optimizer steps per epoch, each over `value_steps` fresh minibatches (DPOK: 1)."""
    value_batch_size: int = 256
    """Buffer transitions per value minibatch (DPOK: 256)."""
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
            (self.clip_eps > 0, "clip_eps must be > 0"),
            (self.buffer_size >= 1, "buffer_size must be >= 1"),
            (self.policy_steps >= 1, "policy_steps must be >= 1"),
            (self.policy_batch_size >= 1, "policy_batch_size must be >= 1"),
            (self.value_steps >= 1, "value_steps must be >= 1"),
            (self.value_updates >= 1, "value_updates must be >= 1"),
            (self.value_batch_size >= 1, "value_batch_size must be >= 1"),
            (self.kl_weight >= 0, "kl_weight must be >= 0"),
            (self.kl_warmup >= 0, "kl_warmup must be >= 0"),
            (self.inner_epochs == 1, "dpok draws policy_steps random buffer minibatches; inner_epochs must be 1"),
            (not self.drop_zero_std_groups, "dpok stores every valid transition; drop_zero_std_groups must be false"),
            (self.reward_aggregation == "sum", "dpok learns the weighted reward sum (reward_aggregation: sum)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# the replay buffer
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Transitions:
    """`n` single denoising steps `x_t -> x_{t+1}` with what DPOK needs to re-score and to learn from them."""

    states: torch.Tensor
    """`[n, ...]` states `x_t` (the model's dtype and latent layout)."""
    next_states: torch.Tensor
    """`[n, ...]` the sampled next states `x_{t+1}`."""
    steps: torch.Tensor
    """`[n]` step indices t (long)."""
    prompts: torch.Tensor
    """`[n]` prompt indices into the trainer's prompt table (long)."""
    log_probs: torch.Tensor
    """`[n]` fp32 behaviour log-probabilities `log p_old(x_{t+1} | x_t, c)`."""
    rewards: torch.Tensor
    """`[n]` fp32 final reward `r(x_0, c)` of the trajectory the step belongs to."""

    FIELDS = ("states", "next_states", "steps", "prompts", "log_probs", "rewards")

    def __len__(self) -> int:
        return len(self.steps)

    def select(self, index) -> Transitions:
        return Transitions(**{name: getattr(self, name)[index] for name in self.FIELDS})

    @classmethod
    def cat(cls, parts: list[Transitions]) -> Transitions:
        return cls(**{name: torch.cat([getattr(p, name) for p in parts]) for name in cls.FIELDS})


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
        cpu = Transitions(**{name: getattr(transitions, name).detach().cpu() for name in Transitions.FIELDS})
        data = cpu if self.data is None else Transitions.cat([self.data, cpu])
        self.data = data.select(slice(max(0, len(data) - self.capacity), None))

    def sample(self, n: int, generator: torch.Generator) -> Transitions:
        """`min(n, len)` distinct random transitions (DPOK draws each minibatch without replacement)."""
        if self.data is None:
            raise ValueError("the replay buffer is empty")
        index = torch.randperm(len(self), generator=generator)[: min(n, len(self))]
        return self.data.select(index)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.data is None:
            return {}
        return {name: getattr(self.data, name) for name in Transitions.FIELDS}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.data = Transitions(**{name: tensors[name] for name in Transitions.FIELDS}) if tensors else None


# ----------------------------------------------------------------------------------------------
# the KL regulariser
# ----------------------------------------------------------------------------------------------


def step_kl(form: str, out: StepOutput, ref: StepOutput, prediction=None, ref_prediction=None,
            reduce: str = "mean") -> torch.Tensor:  # fmt: skip
    """`[n]` per-step KL term of DPOK between the current and the reference step kernels.

    `gaussian`: `KL(N(mu, s^2) || N(mu_ref, s^2)) = red_d (mu - mu_ref)^2 / (2 s^2)` (both kernels share the std
    `s`), the term of DPOK's objective (eq. 9's per-step KL upper bound). `eps_mse`: `red_d (e - e_ref)^2` of the
    guided network predictions, what DPOK's code adds (`kl_regularizer`); for a DDIM kernel it is the exact KL
    divided by `w_t = (sqrt(1 - a' - s^2) - sqrt(a' (1 - a) / a))^2 / (2 s^2)`.
    """
    if form == "gaussian":
        return gaussian_mean_kl(out.mean, ref.mean, out.std, reduce=reduce)
    if form == "eps_mse":
        return reduce_elements((prediction.float() - ref_prediction.float()) ** 2, reduce)
    raise ValueError(f"kl form must be 'gaussian' or 'eps_mse', got {form!r}")


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------


@TRAINERS.register(
    "dpok",
    description="DPOK: clamped policy gradient from a replay buffer, value baseline, per-step KL (arXiv:2305.16381)",
)
class DPOKTrainer(Trainer):
    """DPOK; see the module docstring and `DPOKConfig`."""

    config_class = DPOKConfig

    def setup(self) -> None:
        c = self.config
        self.buffer = ReplayBuffer(c.buffer_size)
        # transitions name their prompt by its index in this table (stable across epochs and resumes)
        self.prompt_table = list(dict.fromkeys(str(p) for p in self.train_prompts))
        self.prompt_index = {text: i for i, text in enumerate(self.prompt_table)}
        self.settings = None  # the current epoch's rollout: sampler settings and schedule for re-scoring
        if c.kl_weight and not (self.policy.has_lora or self.policy.reference_model is not None):
            self.policy.freeze_reference()  # full fine-tuning: the reference is a frozen copy of the base
        self.value_net = None
        if c.use_value:
            text_dim = pooled_text(self.policy.encode(self.prompt_table[:1])).shape[-1]
            with torch.random.fork_rng(devices=[]):  # the same initial value net in every run of this seed
                torch.manual_seed(c.run.seed)
                self.value_net = StateValueNet(self.policy.model.config.in_channels, text_dim, hidden=c.value_hidden)

    def auxiliary_modules(self):
        return {"value": (self.value_net, self.config.value_lr)} if self.value_net is not None else {}

    def compute_advantages(self, rewards, group_ids, prompts=None):
        """The combined final reward of each sample: DPOK's advantages are per transition (`r - V`), at update."""
        return self.combined_reward(rewards), {}

    def kl_coef(self, epoch: int) -> float:
        """beta after the warm-up epochs, 0 before."""
        return self.config.kl_weight if epoch >= self.config.kl_warmup else 0.0

    # ------------------------------------------------------------------------------------------
    # buffer, value, policy
    # ------------------------------------------------------------------------------------------

    def transitions(self, rollout, rewards: torch.Tensor, keep: torch.Tensor) -> Transitions:
        """Every stochastic step of every kept sample, gathered from all processes, trajectory by trajectory.

        (DPOK appends step-major; trajectory order means that an epoch larger than the buffer loses whole
        trajectories rather than all its early steps.)
        """
        ids = torch.tensor([self.prompt_index[p] for p in rollout.prompts])
        latents, log_probs = self._gather(rollout.latents), self._gather(rollout.log_probs)  # [N, T+1, ...], [N, T]
        ids, rewards = self._gather(ids), self._gather(rewards.float())
        rows = self._gather(keep.long()).bool().nonzero().flatten()
        steps = rollout.sde_steps.cpu()
        r, s = rows.repeat_interleave(len(steps)), steps.repeat(len(rows))
        return Transitions(states=latents[r, s], next_states=latents[r, s + 1], steps=s, prompts=ids[r],
                           log_probs=log_probs[r, s].float(), rewards=rewards[r].float())  # fmt: skip

    def conditioning(self, prompts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row conditioning `[n, ...]` of prompt indices (cached text embeddings)."""
        return self.policy.encode([self.prompt_table[i] for i in prompts.tolist()])

    def value(self, batch: Transitions, cond: dict | None = None) -> torch.Tensor:
        """`[n]` baseline `V(x_t, sigma_t, c)` of buffer transitions."""
        module, _ = self.aux["value"]
        device = self.accelerator.device
        cond = self.conditioning(batch.prompts) if cond is None else cond
        sigmas = self.settings.sigmas.cpu()[batch.steps]
        return module(batch.states.to(device), sigmas.to(device), pooled_text(cond).to(device))

    def update(self, rollout, advantages: torch.Tensor, trainable: torch.Tensor, epoch: int) -> dict:
        """Push the epoch's transitions, fit the value network, then `policy_steps` clamped-PG steps."""
        self.settings = rollout
        self.buffer.push(self.transitions(rollout, advantages, trainable))
        stats = EpochStats()
        stats.add_scalar("buffer_size", len(self.buffer))
        rank = self.accelerator.process_index
        if self.value_net is not None:
            self.update_value(seeded(self.config.run.seed, epoch, 20, rank), stats)
        self.update_policy(seeded(self.config.run.seed, epoch, 21, rank), stats)
        return stats.summary()

    def update_value(self, generator: torch.Generator, stats: EpochStats) -> None:
        """`value_updates` optimizer steps, each on `value_steps` minibatches of MSE to the final reward."""
        c = self.config
        module, optimizer = self.aux["value"]
        module.train()
        for _ in range(c.value_updates):
            for i in range(c.value_steps):
                batch = self.buffer.sample(c.value_batch_size, generator)
                sync = i == c.value_steps - 1
                with nullcontext() if sync else self.accelerator.no_sync(module):
                    prediction = self.value(batch)
                    loss = torch.nn.functional.mse_loss(prediction, batch.rewards.to(prediction.device))
                    self.accelerator.backward(loss / c.value_steps)
                stats.add_scalar("value_loss", loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def update_policy(self, generator: torch.Generator, stats: EpochStats) -> None:
        """`policy_steps` optimizer steps, each over `optim.gradient_accumulation` random buffer minibatches."""
        c = self.config
        n = c.optim.gradient_accumulation
        self.model.train()
        for _ in range(c.policy_steps):
            for i in range(n):
                batch = self.buffer.sample(c.policy_batch_size, generator)
                cond = self.conditioning(batch.prompts)
                advantages = batch.rewards.to(self.accelerator.device)
                if self.value_net is not None:
                    with torch.no_grad():
                        advantages = advantages - self.value(batch, cond).float()
                stats.add_scalar("advantage_mean", advantages.mean())
                stats.add_scalar("advantage_abs", advantages.abs().mean())
                sync = i == n - 1
                with nullcontext() if sync else self.accelerator.no_sync(self.model), self.accelerator.autocast():
                    loss, metrics = self.step_loss(batch, advantages, batch.steps, cond=cond)
                    self.accelerator.backward(loss / n)  # the minibatches have equal size: an exact mean
                stats.add(metrics, loss, batch.steps)
            stats.add_scalar("grad_norm", self._optimizer_step())

    def step_loss(self, batch: Transitions, advantages, steps, cond=None):
        """`mean(-alpha A clamp(rho, 1 - eps, 1 + eps)) + beta mean(KL_t)` of buffer transitions `batch`."""
        c = self.config
        device = self.accelerator.device
        cond = self.conditioning(batch.prompts) if cond is None else cond
        states, next_states = batch.states.to(device), batch.next_states.to(device)
        eps_mse = c.kl_weight > 0 and c.kl_form == "eps_mse"
        scored = self.policy.score_transitions(self.settings, states, next_states, steps, cond,
                                               return_prediction=eps_mse)  # fmt: skip
        out, prediction = scored if eps_mse else (scored, None)
        old = batch.log_probs.to(out.log_prob.device)[:, None]  # [n, 1]
        pg_loss, metrics = compute_policy_loss("clamp", out.log_prob[:, None], old, advantages.to(old.device),
                                               eps=c.clip_eps)  # fmt: skip
        metrics = {k: v for k, v in metrics.items() if not k.endswith("_per_step")}
        metrics["approx_kl"] = metrics.pop("approx_kl_k3")
        metrics["pg_loss"] = pg_loss.detach()
        metrics["_ratio"] = (out.log_prob.detach() - old[:, 0]).exp()  # [n], per denoising step in the log
        loss = c.reward_weight * pg_loss
        if c.kl_weight > 0:
            scored = self.policy.score_transitions(self.settings, states, next_states, steps, cond, reference=True,
                                                   return_prediction=eps_mse)  # fmt: skip
            ref, ref_prediction = scored if eps_mse else (scored, None)
            kl = step_kl(c.kl_form, out, ref, prediction, ref_prediction, reduce=self.policy.reduce)  # [n]
            loss = loss + self.kl_coef(self.epoch) * kl.mean()
            metrics["kl"] = kl.mean().detach()
        return loss, metrics

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
