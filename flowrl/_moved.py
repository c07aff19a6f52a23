"""Module paths that moved: importing an old path warns (`DeprecationWarning`) and gives the new module itself.

`MOVED` is the one table of old module path -> new module path; a module (or package) that moves adds its row here.
The finder is installed on `sys.meta_path` when `flowrl` is imported, so an old path such as
`flowrl.trainers.driver` imports as `flowrl.run.driver`: the same module object, in `sys.modules` under both names,
so code, checkpoints and pickles that name an old path still load. A row of a package covers its submodules
(`old.sub` is `new.sub`). An old path must not be a module of its own any more (`tests/test_moved.py`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


MOVED: dict[str, str] = {
    # #46: the run machinery left flowrl/trainers/ for flowrl/run/; the algorithms are grouped by modality
    "flowrl.trainers.advantages": "flowrl.run.advantages",
    "flowrl.trainers.algorithm": "flowrl.run.algorithm",
    "flowrl.trainers.artifacts": "flowrl.run.artifacts",
    "flowrl.trainers.async_rollouts": "flowrl.run.async_rollouts",
    "flowrl.trainers.driver": "flowrl.run.driver",
    "flowrl.trainers.engine": "flowrl.run.engine",
    "flowrl.trainers.ess": "flowrl.run.ess",
    "flowrl.trainers.grad_probe": "flowrl.run.grad_probe",
    "flowrl.trainers.inference": "flowrl.run.inference",
    "flowrl.trainers.inline_rollouts": "flowrl.run.inline_rollouts",
    "flowrl.trainers.learner_group": "flowrl.run.learner_group",
    "flowrl.trainers.local_ray": "flowrl.run.local_ray",
    "flowrl.trainers.registry": "flowrl.run.registry",
    "flowrl.trainers.run_folder": "flowrl.run.run_folder",
    "flowrl.trainers.run_loop": "flowrl.run.run_loop",
    "flowrl.trainers.scheduler": "flowrl.run.scheduler",
    "flowrl.trainers.sharding": "flowrl.run.sharding",
    "flowrl.trainers.state": "flowrl.run.state",
    "flowrl.trainers.stats": "flowrl.run.stats",
    "flowrl.trainers.wire": "flowrl.run.wire",
    "flowrl.trainers.acflow": "flowrl.trainers.image.acflow",
    "flowrl.trainers.awm": "flowrl.trainers.image.awm",
    "flowrl.trainers.dgpo": "flowrl.trainers.image.dgpo",
    "flowrl.trainers.diffusion_dpo": "flowrl.trainers.image.diffusion_dpo",
    "flowrl.trainers.dpok": "flowrl.trainers.image.dpok",
    "flowrl.trainers.find": "flowrl.trainers.image.find",
    "flowrl.trainers.flow_dppo": "flowrl.trainers.image.flow_dppo",
    "flowrl.trainers.flow_grpo": "flowrl.trainers.image.flow_grpo",
    "flowrl.trainers.gardo": "flowrl.trainers.image.gardo",
    "flowrl.trainers.grpo_guard": "flowrl.trainers.image.grpo_guard",
    "flowrl.trainers.image_fpo": "flowrl.trainers.image.image_fpo",
    "flowrl.trainers.loop": "flowrl.trainers.image.loop",
    "flowrl.trainers.nft": "flowrl.trainers.image.nft",
    "flowrl.trainers.tempflow_grpo": "flowrl.trainers.image.tempflow_grpo",
    "flowrl.trainers.window_grpo": "flowrl.trainers.image.window_grpo",
    "flowrl.trainers.bc": "flowrl.trainers.control.bc",
    "flowrl.trainers.dppo": "flowrl.trainers.control.dppo",
    "flowrl.trainers.fpo": "flowrl.trainers.control.fpo",
    "flowrl.trainers.ppo": "flowrl.trainers.control.ppo",
    "flowrl.trainers.matching": "flowrl.trainers.shared.matching",
    "flowrl.trainers.preference": "flowrl.trainers.shared.preference",
    # (flowrl.trainers.image, .control and .text are packages now: ImageAlgorithm and ControlAlgorithm are in
    # flowrl.trainers.shared.image and .control, the text trainer in flowrl.trainers.text.text)
    # #46: the family registry beside its families (no policies <-> models circle): `ModelAdapter` and its options in
    # flowrl.models.adapter; MODEL_FAMILIES, register_family and adapter_for in flowrl.models.families; the helpers
    # families share (guidance_embedding, decode_vae, text_kwargs) in flowrl.models.helpers. The policy built from a
    # run's model section is flowrl.policies' (flowrl.models no longer imports flowrl.policies).
    "flowrl.policies.adapters": "flowrl.models.adapter",
    "flowrl.models.build": "flowrl.policies.build",
    # #46: reward serving apart from the reward models (flowrl.rewards.serving), the text objectives in one folder
    # (flowrl.core.text; flowrl.core.llm_objectives was split into flowrl.core.text.clipping, .sequence and .reinforce)
    "flowrl.rewards.executor": "flowrl.rewards.serving.executor",
    "flowrl.rewards.http": "flowrl.rewards.serving.http",
    "flowrl.rewards.server": "flowrl.rewards.serving.server",
    "flowrl.rewards.server_app": "flowrl.rewards.serving.server_app",
    "flowrl.rewards.server_requests": "flowrl.rewards.serving.server_requests",
    "flowrl.core.humanline": "flowrl.core.text.humanline",
    "flowrl.core.troll": "flowrl.core.text.troll",
    "flowrl.core.llm_entropy_objectives": "flowrl.core.text.entropy",
    "flowrl.core.llm_group_objectives": "flowrl.core.text.group",
}
"""Old module path -> the module it is now (old paths keep working, with a `DeprecationWarning`)."""


def new_path(name: str) -> str | None:
    """The module `name` (an old path, or a submodule of an old package path) is now; None if it did not move."""
    for old in sorted(MOVED, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return MOVED[old] + name[len(old) :]
    return None


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and loads each as its new module (see the module docstring)."""

    def __init__(self):
        self.specs: dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        if new_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,  # the importer's line (the import system's own frames are skipped)
        )
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__  # the import system sets the old path's spec on it: restored below
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__spec__.name)


def install() -> None:
    """Put the finder first on `sys.meta_path` (once per process)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
