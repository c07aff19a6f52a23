"""The control modality's config: the environments, the value network, GAE, evaluation episodes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from flowrl.sections import BaseConfig, BatchConfig, EvalConfig, HasObjective, OptimConfig, RunConfig


@dataclasses.dataclass
class EnvConfig:
    """The Gymnasium environments (the `rl` extra: `pip install 'flowrl-toolkit[rl]'`)."""

    id: str = "Pendulum-v1"
    """A registered Gymnasium id with a Box action space (`Pendulum-v1`, `HalfCheetah-v5`, `Hopper-v5`,
    `flowrl/BimodalPointMass-v0`, ...)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of `gymnasium.make`."""
    num_envs: int = 4
    """Environments stepped together, over every process (each steps its share)."""
    vectorization: Literal["sync", "async"] = "sync"
    """How a process steps its environments: `sync` one after another in the process (gymnasium's
    `SyncVectorEnv`), `async` each in its own worker process (`AsyncVectorEnv`, shared memory). The same
    transitions either way; `async` pays when one environment's step costs more than the round trip to a worker
    (heavy simulators, many cores), not for Pendulum or HalfCheetah (`docs/control.md`). Evaluation steps sync."""
    steps_per_env: int = 1024
    """Steps per environment per epoch: an epoch's rollout has `num_envs * steps_per_env` transitions."""
    continue_episodes: bool = False
    """Keep each environment's episode running from one epoch into the next, as SB3's rollouts do. Off: every
    epoch starts fresh episodes from `(run.seed, epoch)` seeds, so with `steps_per_env` below the episode length
    the later part of an episode is never trained on (though evaluation runs it), and a resumed run repeats the
    uninterrupted one exactly. On: training sees whole episodes; a resumed run's first epoch starts fresh
    episodes (environment states are not checkpointed), so it is not bit-identical to an uninterrupted run."""
    normalize_obs: bool = False
    """Normalise observations by running statistics (SB3's `VecNormalize`); frozen within an epoch's update."""
    normalize_reward: bool = False
    """Divide rewards by the running std of the discounted return (SB3's `VecNormalize`)."""
    clip_obs: float = 10.0
    """Clip normalised observations to `[-clip_obs, clip_obs]`."""
    clip_reward: float = 10.0
    """Clip scaled rewards to `[-clip_reward, clip_reward]`."""


@dataclasses.dataclass
class GAEConfig:
    """The advantage of a transition: GAE over the environment steps with the value network as baseline."""

    selector: ClassVar[str] = "estimator"
    estimator: Literal["gae"] = "gae"
    """The estimator (`flowrl list advantage_estimators`; control trains on `gae`)."""
    gamma: float = 0.99
    """Discount."""
    lam: float = 0.95
    """GAE lambda (1: Monte-Carlo returns with a baseline)."""
    normalize: bool = True
    """Whiten each mini-batch's advantages by its mean and std over every process (SB3, CleanRL)."""

    def __post_init__(self):
        if not (0 < self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("advantage.gamma must lie in (0, 1], advantage.lam in [0, 1]")


@dataclasses.dataclass
class ControlCriticConfig:
    """The value MLP `V(obs)`, trained with the policy by the same optimizer (`vf_coef`)."""

    hidden: int = 64
    """Hidden width."""
    depth: int = 2
    """Hidden layers."""
    activation: Literal["tanh", "relu", "silu"] = "tanh"
    """Activation."""
    warmup_epochs: int = 0
    """Epochs at the start of a run in which only the value network trains (the policy loss carries no gradient):
    DPPO's critic warm-up (`n_critic_warmup_itr`) before fine-tuning a pre-trained policy (`init_from`), so the first
    advantages do not come from an untrained critic."""
    ortho_init: bool = True
    """Orthogonal init (gain sqrt(2), 1 for the output), else PyTorch's default. SB3's `ortho_init` covers the
    policy and the value network alike: a zoo config with `ortho_init: False` sets it here and in `policy`."""


@dataclasses.dataclass
class ControlEvalConfig(EvalConfig):
    """Evaluation episodes on the environment."""

    every: int = 10
    """Evaluate every this many epochs (and always before the first and after the last); 0: start and end only."""
    episodes: int = 10
    """Episodes per evaluation, from the same seeds each time."""
    deterministic: bool = True
    """Evaluation actions: the Gaussian's mean, a flow's integration from zero noise (FPO++'s zero-sampling);
    False samples as in training."""


def _control_optim() -> OptimConfig:
    # SB3 / CleanRL PPO: Adam (weight decay 0), eps 1e-5, gradient-norm clip 0.5
    return OptimConfig(lr=3e-4, weight_decay=0.0, eps=1e-5, max_grad_norm=0.5)


def _control_run() -> RunConfig:
    return RunConfig(epochs=25, save_every=0, samples_every=0)


def _control_batch() -> BatchConfig:
    # SB3's PPO: 10 epochs of minibatches of 64 transitions
    return BatchConfig(mini_batch_size=64, micro_batch_size=64, inner_epochs=10)


@dataclasses.dataclass
class ControlConfig(BaseConfig):
    """What every control trainer has: environments, evaluation episodes, the optimizer and batch defaults, the
    environment-step budget and `init_from`. The RL trainers add the actor-critic's sections (`ActorCriticConfig`);
    behaviour cloning has none of them."""

    renamed: ClassVar[dict[str, str]] = {
        "minibatch_size": "batch.mini_batch_size (transitions per optimizer step, over every process)",
        "gamma": "advantage.gamma",
        "gae_lambda": "advantage.lam",
        "normalize_advantage": "advantage.normalize",
    }
    absent: ClassVar[dict[str, str]] = {
        "rewards": "control trainers take their reward from the environment",
        "prompts": "control trainers step environments (env), not prompts",
        "model": "control trainers build their policy network from the algorithm's `policy` section",
        "sampling": "control trainers sample actions with their policy (`policy`), not images",
        "kl": "control trainers have no regulariser to a reference",
        "steps": "control trainers train every element of a transition",
        "ent_coef": "only ppo's Gaussian policy has an entropy bonus",
    }

    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """The environments."""
    eval: ControlEvalConfig = dataclasses.field(default_factory=ControlEvalConfig)
    """Evaluation episodes."""
    optim: OptimConfig = dataclasses.field(default_factory=_control_optim)
    """The optimizer of the policy and the value network together."""
    run: RunConfig = dataclasses.field(default_factory=_control_run)
    """Run folder, epochs, seeds, logging, checkpoints."""
    batch: BatchConfig = dataclasses.field(default_factory=_control_batch)
    """Transitions per optimizer step (over every process) and per call; PPO epochs (SB3: 64, 10)."""
    total_env_steps: int | None = None
    """Environment-step budget; when set, `run.epochs = ceil(total_env_steps / (num_envs * steps_per_env))`."""
    init_from: str | None = None
    """A control run folder (its latest checkpoint) or one of its checkpoint folders whose policy network starts
    this run: a behaviour-cloning run (`bc`) fine-tuned by `fpo` or `dppo`, or any run of the same policy network on
    the same environment. Its actor's weights (the EMA ones when it kept them) are copied; the value network starts
    fresh. Runs that normalise observations cannot be a source or a target (their statistics would not carry)."""

    def __post_init__(self):
        if self.total_env_steps is not None:
            if self.total_env_steps < 1:
                raise ValueError("total_env_steps must be >= 1")
            self.run.epochs = max(1, math.ceil(self.total_env_steps / (self.env.num_envs * self.env.steps_per_env)))
        super().__post_init__()

    def checks(self) -> list[tuple[bool, str]]:
        e = self.env
        return [
            *super().checks(),
            (e.num_envs >= 1 and e.steps_per_env >= 1, "env.num_envs and env.steps_per_env must be >= 1"),
            (self.eval.episodes >= 1, "eval.episodes must be >= 1"),
            (
                not (e.continue_episodes and self.run.mode == "async"),
                "env.continue_episodes keeps episodes running in the process that steps them; run.mode=async samples "
                "epochs on any rollout worker: use one or the other",
            ),
            (
                self.init_from is None or not e.normalize_obs,
                "init_from: a policy trained on raw observations cannot start a run with env.normalize_obs",
            ),
        ]


@dataclasses.dataclass
class ActorCriticConfig(HasObjective, ControlConfig):
    """The control RL trainers (`ppo`, `fpo`, `dppo`): a ratio objective, a value network and GAE advantages."""

    critic: ControlCriticConfig = dataclasses.field(default_factory=ControlCriticConfig)
    """The value network."""
    advantage: GAEConfig = dataclasses.field(default_factory=GAEConfig)
    """GAE."""
    vf_coef: float = 0.5
    """Weight of the value loss `mean((V - returns)^2)` (SB3's MSE without 1/2)."""
    clip_vf: float | None = None
    """Clip the value prediction to `values_old +- clip_vf` (CleanRL's value clipping; SB3: off)."""

    def checks(self) -> list[tuple[bool, str]]:
        return [
            *super().checks(),
            (self.vf_coef >= 0, "vf_coef must be >= 0"),
            (self.critic.warmup_epochs >= 0, "critic.warmup_epochs must be >= 0"),
        ]
