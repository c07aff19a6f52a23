"""Trainers: thin algorithm layers on one shared loop (`flowrl.trainers.base`) and one objective core.

Each trainer module registers its trainer in `TRAINERS` when imported; importing this package imports them.
"""

# the trainers register themselves on import
from flowrl.trainers.acflow import ACFlowConfig, ACFlowTrainer
from flowrl.trainers.base import Trainer, TrainerConfig
from flowrl.trainers.dpok import DPOKConfig, DPOKTrainer
from flowrl.trainers.find import FINDConfig, FINDTrainer
from flowrl.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from flowrl.trainers.grpo_guard import GRPOGuardConfig, GRPOGuardTrainer
from flowrl.trainers.loop import LOOPConfig, LOOPTrainer
from flowrl.trainers.registry import TRAINERS


def build_trainer(config, **kwargs) -> Trainer:
    """The trainer named by `config.trainer`, built from its config."""
    return TRAINERS.get(config.trainer)(config, **kwargs)


__all__ = [
    "TRAINERS",
    "ACFlowConfig",
    "ACFlowTrainer",
    "DPOKConfig",
    "DPOKTrainer",
    "FINDConfig",
    "FINDTrainer",
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
