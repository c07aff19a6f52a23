"""Memory planning: a run's GPU memory per phase traced on `meta` tensors at the real shapes (`flowrl plan`), and the
check `flowrl train` runs before it loads anything on a GPU."""

from __future__ import annotations

import os

from flowrl.plan.plan_cache import cached_plan
from flowrl.plan.planner import USABLE, MemoryPlan, PhasePeak, plan


class WillNotFit(ValueError):
    """A run whose plan does not fit its GPUs."""


def check_fits(config, *, log=print) -> MemoryPlan | None:
    """Before a run on a CUDA GPU: its plan at this launch's process count and this GPU's memory; a run that will not
    fit raises one line naming the setting to change (`run.check_memory: false` skips the check). Nothing is checked
    on CPUs, for other modalities, or where the model's architecture is not known without its weights (a line says
    so)."""
    import torch

    if not config.run.check_memory or config.run.cpu or not torch.cuda.is_available():
        return None
    from flowrl.image import ImageConfig

    if not isinstance(config, ImageConfig) or config.model.name == "digits":
        return None
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    try:
        result = cached_plan(config, gpus=gpus, gpu_memory=memory)  # traced once per config, code and GPU
    except (ValueError, FileNotFoundError, KeyError, NotImplementedError) as err:
        if "not supported here" in str(err) or "must split over" in str(err):
            raise  # the run itself would refuse it
        if log:
            log(f"flowrl train: memory not planned ({' '.join(str(err).split())[:200]})")
        return None
    refusal = result.refusal()
    if refusal:
        raise WillNotFit(f"{refusal} (`flowrl plan` shows every phase; run.check_memory: false skips this check)")
    return result


__all__ = ["USABLE", "MemoryPlan", "PhasePeak", "WillNotFit", "check_fits", "plan"]
