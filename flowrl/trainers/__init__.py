"""Trainers: thin algorithm layers on one shared loop (`flowrl.trainers.base`) and one objective core."""

from flowrl.registry import Registry
from flowrl.trainers.base import Trainer, TrainerConfig
from flowrl.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from flowrl.trainers.grpo_guard import GRPOGuardConfig, GRPOGuardTrainer
from flowrl.trainers.loop import LOOPConfig, LOOPTrainer


TRAINERS: Registry = Registry("trainer")
TRAINERS.register(
    "flow_grpo",
    FlowGRPOTrainer,
    description="Flow-GRPO: PPO-clip on flow-SDE step log-probs with group advantages (arXiv:2505.05470)",
)
TRAINERS.register(
    "grpo_guard",
    GRPOGuardTrainer,
    description="GRPO-Guard: Flow-GRPO with RatioNorm and 1/|dt| step weights (arXiv:2510.22319)",
)
TRAINERS.register(
    "loop",
    LOOPTrainer,
    description="LOOP: PPO-clip over several inner epochs with a leave-one-out baseline (arXiv:2503.00897)",
)


def build_trainer(config, **kwargs) -> Trainer:
    """The trainer named by `config.trainer`, built from its config."""
    return TRAINERS.get(config.trainer)(config, **kwargs)


__all__ = [
    "TRAINERS",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "GRPOGuardConfig",
    "GRPOGuardTrainer",
    "LOOPConfig",
    "LOOPTrainer",
    "Trainer",
    "TrainerConfig",
    "build_trainer",
]
