"""Trainers: the algorithms, grouped by modality, on the run machinery of `flowrl.run`.

`image/`, `control/` and `text/` hold one algorithm per module (its config class and its `Algorithm` subclass,
registered under its name); `shared/` holds what several algorithms build on (the modality bases, the final-sample
family's draws, Flow-GRPO's step trainer, the control policies), so no algorithm imports another. Every module of
this package and of its subpackages is imported here, so an algorithm registers itself by being a module of it (a
new trainer is one file plus its test). `load_config` reads a run config and picks the trainer's config class from
its `trainer` key; `build_trainer` assembles the run (`flowrl.run.driver.Trainer`).
"""

from __future__ import annotations

import importlib
import pkgutil

from flowrl.run.algorithm import Algorithm
from flowrl.run.driver import Trainer
from flowrl.run.inference import load_run
from flowrl.run.registry import TRAINERS, load_config, register


_modules = [module.name for module in pkgutil.walk_packages(__path__, prefix=f"{__name__}.") if not module.ispkg]
for _name in sorted(_modules, key=lambda name: name.rsplit(".", 1)[1]):  # the trainers listed by module name
    importlib.import_module(_name)


def build_trainer(config, **kwargs) -> Trainer:
    """The run of `config.trainer` assembled from its config (`Trainer`)."""
    return Trainer(config, **kwargs)


__all__ = ["TRAINERS", "Algorithm", "Trainer", "build_trainer", "load_config", "load_run", "register"]
