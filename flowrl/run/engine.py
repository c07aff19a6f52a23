"""The engine of a run: device, precision, process group, sharding, the optimizers and gradient handling.

`Engine` owns accelerate's `Accelerator` (one process on a CPU, `torchrun` / `accelerate launch` for many), the
trained module (DDP-prepared, FSDP2-sharded or inside a DeepSpeed ZeRO engine), its optimizer, the EMA of its weights
and any auxiliary networks with optimizers of their own (critics, value networks). It runs backward passes (a loss is
always this process's share of a global sum, so gradients are summed over the processes), clips, steps, skips and
counts non-finite steps, and gathers and scatters sharded states for checkpoints. It knows nothing of images, tokens
or actions, nor of mini-batches (`flowrl.run.scheduler` cuts those).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from flowrl.core.dist import sum_gradients
from flowrl.run import sharding
from flowrl.run.state import EMA
from flowrl.runtime import Processes, RunContext
from flowrl.sections import OptimConfig, RunConfig
from flowrl.threads import ThreadGovernor
from flowrl.tracking import PeakMemory


class NonFiniteError(RuntimeError):
    """Too many optimizer steps had a NaN or infinite gradient."""


class LaunchError(RuntimeError):
    """The processes were launched in a way that cannot form one training group."""


class Engine:
    """See the module docstring.

    Args:
        run (`RunConfig`), optim (`OptimConfig`): the run's sections.
        project_dir: the run folder (accelerate's trackers write there).
        ema_decay (`float`, *optional*), ema_every (`int`): the EMA of the trained weights.
    """

    def __init__(
        self, run: RunConfig, optim: OptimConfig, project_dir, *, ema_decay: float | None = None, ema_every: int = 8
    ):
        from accelerate import Accelerator

        check_launch()
        self.run, self.optim = run, optim
        shard = launch_shard(run.shard)  # before accelerate reads its launcher's DeepSpeed/FSDP settings
        run.mixed_precision = launch_precision(run.mixed_precision)  # the accelerate config's, unless the run's
        check_trackers(run.log_with)
        # without a GPU, the CPU explicitly: accelerate then forms a gloo group of the processes `torchrun`
        # starts (asked for the default device, it would leave each one a separate single-process run)
        cpu = run.cpu or not torch.cuda.is_available()
        self.accelerator = Accelerator(
            cpu=cpu, mixed_precision=run.mixed_precision, log_with=run.log_with or None, project_dir=str(project_dir)
        )
        self.processes = Processes(self.accelerator)
        self.threads = ThreadGovernor(run.threads)  # measures from here: model loading is the first interval
        self.memory = PeakMemory(self.accelerator.device)
        if self.accelerator.device.type == "cuda":  # TF32 for fp32 matrix products (fp32 LoRA, rewards): the
            torch.backends.cuda.matmul.allow_tf32 = True  # rollout and the update share it, so the ratio stays 1
            torch.backends.cudnn.allow_tf32 = True
        self.shard = shard if self.processes.world > 1 else "none"
        """How the trained model is split over the processes (`run.shard`, or the accelerate config's)."""
        self.ema_decay, self.ema_every = ema_decay, ema_every
        self.optimizer_steps = 0
        """Optimizer steps taken (EMA updates count them)."""
        self.nonfinite_steps = 0
        """Steps skipped for a NaN or infinite gradient (`optim.max_nonfinite_steps`)."""
        self.epoch = 0
        """The epoch being trained (1-based; the run driver sets it), for messages."""
        self.model = self.optimizer = self.ema = None
        self.params: list[torch.nn.Parameter] = []
        self.aux: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
        self.zero_backward = None
        # one process, no mixed precision: accelerate's backward and clipping would only add per-call overhead
        # (it re-checks installed packages on every call: 0.2 ms, a third of a small control minibatch)
        self.plain = (self.processes.world == 1 or self.sharded) and run.mixed_precision == "no"

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (FSDP2 or ZeRO): its forward and backward calls are collectives."""
        return self.shard != "none"

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.processes.is_main

    def context(self) -> RunContext:
        """What a modality's parts may use of the run."""
        return RunContext(self.processes, autocast=self.accelerator.autocast, log=print if self.is_main else None)

    def autocast(self):
        """Mixed precision for training forwards (nothing when plain)."""
        return nullcontext() if self.plain else self.accelerator.autocast()

    def no_sync(self):
        """DDP: gradients stay local until `step` reduces them; sharded: each backward reduces its share."""
        return nullcontext() if self.sharded else self.accelerator.no_sync(self.model)

    # ------------------------------------------------------------------------------------------
    # the trained module and its optimizer
    # ------------------------------------------------------------------------------------------

    def check_shardable(self, refusals: list[str]) -> None:
        """Refuse `run.shard` (FSDP2, ZeRO) where flowrl does not keep the processes' forward and backward calls in
        step or keeps copies of the full parameters; `refusals` are the algorithm's own reasons."""
        check_shardable(self.shard, self.run, self.optim, self.ema_decay, refusals)

    def prepare(
        self,
        module: torch.nn.Module,
        *,
        aux: dict[str, tuple[torch.nn.Module, float]] | None = None,
        optimizer_options: dict[str, dict] | None = None,
        refusals: list[str] = (),
    ) -> torch.nn.Module:
        """Shard or prepare `module`, build its optimizer (AdamW or RMSprop from `optim`), the EMA and each auxiliary
        network's AdamW (`aux`: `{name: (module, learning rate)}`); returns what training forwards call."""
        opt = self.optim
        if self.run.offload and not self.sharded:
            raise ValueError(
                "run.offload moves the shards of a sharded model: it needs run.shard fsdp2, zero2 or "
                "zero3 (or an FSDP / DeepSpeed launcher config) and several processes"
            )
        if self.sharded:
            self.check_shardable(list(refusals))
        if self.shard == "fsdp2":
            sharding.shard(
                module,
                self.processes.world,
                self.device,
                bf16=self.run.mixed_precision == "bf16",
                offload=self.run.offload,
            )
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"the trained {type(module).__name__} has no trainable parameters")
        options = {
            **fused_options(params, self.shard, opt.optimizer),
            **(optimizer_options or {}).get(opt.optimizer, {}),
        }
        if opt.optimizer == "rmsprop":
            optimizer = torch.optim.RMSprop(params, lr=opt.lr, alpha=0.99, eps=opt.eps, weight_decay=0.0, **options)
        else:
            optimizer = torch.optim.AdamW(
                params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay, eps=opt.eps, **options
            )
        if self.shard in sharding.ZERO_STAGES:  # DeepSpeed's engine wraps both; its optimizer steps the partitions
            engine = sharding.zero_engine(
                module, optimizer, sharding.ZERO_STAGES[self.shard], opt.max_grad_norm, offload=self.run.offload
            )
            self.model, self.optimizer = engine, engine.optimizer
            self.zero_backward = sharding.ZeroBackward(engine, self.processes.world)
        elif self.sharded:  # FSDP2: the module is sharded in place, not wrapped; flowrl steps the raw optimizer
            self.model, self.optimizer = module, optimizer
        else:
            self.model, self.optimizer = self.accelerator.prepare(module, optimizer)
        self.params = params
        for name, (aux_module, lr) in (aux or {}).items():
            aux_opt = torch.optim.AdamW(aux_module.parameters(), lr=lr, weight_decay=0.0)
            self.aux[name] = self.accelerator.prepare(aux_module.to(self.device), aux_opt)
        self.ema = EMA(params, self.ema_decay) if self.ema_decay else None
        return self.model

    def unwrapped(self) -> torch.nn.Module:
        """The trained module itself (DDP's wrapper removed): what samples and scores without gradient."""
        return self.accelerator.unwrap_model(self.model)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------------------------------
    # backward and step
    # ------------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass of this process's share of a global loss (accelerate's, which scales mixed-precision
        losses, unless `plain`; DeepSpeed's under ZeRO)."""
        if self.zero_backward is not None:
            self.zero_backward(loss)
        else:
            loss.backward() if self.plain else self.accelerator.backward(loss)

    def step(self) -> float:
        """Sum the gradients over the processes (each process's losses are its shares of the global loss), clip them,
        step the optimizer (and the EMA); returns the gradient norm. A non-finite gradient skips the step."""
        if self.zero_backward is not None:  # DeepSpeed reduces, clips and skips a non-finite step itself
            norm = self.zero_backward.step()
            if not math.isfinite(norm):
                self._skip_nonfinite(norm)
            else:
                self._stepped()
            return norm
        if not self.sharded and self.processes.world > 1:
            sum_gradients(self.params)  # a process whose share of the mini-batch was empty adds zeros
        max_norm = self.optim.max_grad_norm
        if self.sharded:  # the norm of the whole gradient (a collective over the shards); inf: measure only
            norm = sharding.local_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm or math.inf))
        elif max_norm is not None and self.plain:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        elif max_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.params, max_norm)
        else:
            grads = [p.grad.norm() for p in self.params if p.grad is not None]
            norm = torch.norm(torch.stack(grads)) if grads else torch.zeros(())
        # accelerate's wrapper: the same step (a sharded run holds the raw optimizer)
        optimizer = self.optimizer.optimizer if self.plain and not self.sharded else self.optimizer
        # the same on every process (the gradients were reduced first); fp16's loss scaler skips its own overflows
        if not math.isfinite(float(norm)) and self.run.mixed_precision != "fp16":
            optimizer.zero_grad(set_to_none=True)
            self._skip_nonfinite(float(norm))
            return float(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._stepped()
        return float(norm)

    def _stepped(self) -> None:
        """Count an optimizer step and update the EMA when due."""
        self.optimizer_steps += 1
        if self.ema is not None and self.optimizer_steps % self.ema_every == 0:
            self.ema.update()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (an early stop before the step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def _skip_nonfinite(self, norm: float) -> None:
        """Count a skipped step; past `optim.max_nonfinite_steps` stop the run (its last checkpoint stays)."""
        self.nonfinite_steps += 1
        limit = self.optim.max_nonfinite_steps
        if self.nonfinite_steps > limit:
            raise NonFiniteError(
                f"{self.nonfinite_steps} optimizer steps had a non-finite gradient (norm {norm}) by "
                f"epoch {self.epoch}, more than optim.max_nonfinite_steps={limit}: lower optim.lr or "
                "check the rewards; the last checkpoint is kept"
            )

    def aux_module(self, name: str) -> torch.nn.Module:
        """The auxiliary network `name` itself (its forwards bypass DDP: `aux_step` reduces its gradients)."""
        return self.accelerator.unwrap_model(self.aux[name][0])

    def aux_step(self, name: str, loss: torch.Tensor) -> None:
        """One optimizer step of the auxiliary network `name` on `loss` (computed with `aux_module(name)`), this
        process's share of a global loss: its gradient is summed over the processes, so the step is the
        one-process step on the whole batch."""
        module, optimizer = self.aux[name]
        loss.backward()
        if self.processes.world > 1:
            sum_gradients(module.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluation_weights(self):
        """The EMA weights swapped in, when the run keeps them (a context manager)."""
        return self.ema.swapped() if self.ema is not None else nullcontext()

    # ------------------------------------------------------------------------------------------
    # checkpoint state
    # ------------------------------------------------------------------------------------------

    def state_files(self) -> dict | None:
        """A sharded run's full model and optimizer states, gathered (a collective) as checkpoint files."""
        if not self.sharded:
            return None
        if self.zero_backward is not None:
            model, optim, metadata = sharding.zero_full_state(self.model)
        else:
            model, optim, metadata = sharding.full_state(self.model, self.optimizer)
        return {sharding.MODEL_FILE: (model, None), sharding.OPTIMIZER_FILE: (optim, metadata)}

    def load_state_files(self, folder: Path) -> None:
        """A sharded run's model and optimizer from the full states its checkpoint holds."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        from flowrl import checkpoint

        if not self.sharded:
            return
        model_file, optim_file = folder / sharding.MODEL_FILE, folder / sharding.OPTIMIZER_FILE
        if not model_file.is_file() or not optim_file.is_file():
            raise checkpoint.CheckpointMismatch(
                f"checkpoint {folder} was not written by a sharded run (no "
                f"{sharding.MODEL_FILE}); resume it with run.shard: none"
            )
        with safe_open(str(optim_file), "pt") as f:
            metadata = f.metadata() or {}
        try:
            model, optim = load_file(model_file), load_file(optim_file)
            if self.zero_backward is not None:
                sharding.zero_load_full_state(self.model, model, optim, metadata)
            else:
                sharding.load_full_state(self.model, self.optimizer, model, optim, metadata)
        except (RuntimeError, ValueError, KeyError) as err:
            detail = " ".join(str(err).split())[:300]
            raise checkpoint.CheckpointMismatch(
                f"checkpoint {folder} does not fit this run's model or optimizer: {detail}"
            ) from None


def check_shardable(
    shard: str, run: RunConfig, optim: OptimConfig, ema_decay: float | None, refusals: list[str] = ()
) -> None:
    """Refuse `run.shard` (`shard`: FSDP2, ZeRO) where flowrl does not keep the processes' calls in step or where a
    setting needs what the shards do not hold; `refusals` are the algorithm's own reasons. The run's engine and
    `flowrl plan` (at any process count) ask the same."""
    if shard == "none":
        return
    reasons = list(refusals)
    if ema_decay and shard == "zero3":
        reasons.append(
            "ema_decay keeps an EMA of the parameters, which ZeRO-3 partitions (use run.shard: fsdp2, "
            "whose EMA is sharded like the parameters, or zero2)"
        )
    if optim.step_grad_norms_every:
        reasons.append("optim.step_grad_norms_every measures full per-step gradients")
    if run.mixed_precision == "fp16":
        reasons.append(
            "fp16 needs a loss scaler over the shards, which flowrl does not keep (use run.mixed_precision: bf16)"
        )
    if shard in sharding.ZERO_STAGES and optim.optimizer != "adamw":
        reasons.append("ZeRO runs keep AdamW's state (use optim.optimizer: adamw)")
    if reasons:
        raise ValueError(
            f"run.shard: {shard} is not supported here: {'; '.join(reasons)}. Use run.shard: none "
            "(DDP), or a trainer on the shared update (flow_grpo, grpo_guard, ...)"
        )


def fused_options(params: list[torch.nn.Parameter], shard: str, optimizer: str = "adamw") -> dict:
    """`{"fused": True}` for AdamW over CUDA parameters (one kernel per step instead of a loop of them), unless
    DeepSpeed steps the partitions (ZeRO keeps its own flat fp32 copies)."""
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    if optimizer != "adamw" or shard in sharding.ZERO_STAGES or not on_cuda:
        return {}
    return {"fused": True}


def launch_shard(shard: str, environ=None) -> str:
    """`run.shard` under an accelerate config that asks for sharding: `distributed_type: DEEPSPEED` with ZeRO
    stage 2 or 3 is `zero2` / `zero3`, `distributed_type: FSDP` is `fsdp2` (configs/accelerate/). flowrl shards the
    model itself, so accelerate's own DeepSpeed and FSDP wrapping are switched off in `environ` (it only launched
    the processes); a `run.shard` that names another kind is refused."""
    env = os.environ if environ is None else environ
    asked = None
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        if stage not in ("2", "3"):
            raise LaunchError(
                f"the accelerate config asks for DeepSpeed ZeRO stage {stage}; flowrl runs stages 2 "
                "and 3 (configs/accelerate/zero2.yaml, zero3.yaml)"
            )
        asked = f"zero{stage}"
    elif env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        asked = "fsdp2"
    if asked is None:
        return shard
    if shard not in ("none", asked):
        raise LaunchError(f"the accelerate config launches {asked} but run.shard is {shard!r}: drop one of them")
    env["ACCELERATE_USE_DEEPSPEED"] = env["ACCELERATE_USE_FSDP"] = "false"
    return asked


def launch_precision(precision: str, environ=None) -> str:
    """`run.mixed_precision` under an accelerate config's `mixed_precision` (`accelerate launch` exports it as
    `ACCELERATE_MIXED_PRECISION`): the config's when the run leaves the default `no`; a run that names another
    precision than the config is refused (one of them would be silently ignored)."""
    env = os.environ if environ is None else environ
    asked = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if asked in ("no", precision):
        return precision
    if asked not in ("bf16", "fp16"):
        raise LaunchError(f"the accelerate config asks for mixed_precision {asked!r}; flowrl runs no, bf16, fp16")
    if precision != "no":
        raise LaunchError(
            f"the accelerate config asks for mixed_precision {asked} but run.mixed_precision is "
            f"{precision}: drop one of them"
        )
    return asked


def check_launch(environ=None) -> None:
    """Refuse `accelerate launch --cpu --num_processes N`: accelerate's simple launcher starts one process (it
    sets a rendezvous address but no world size), which would train alone while the user counts on N."""
    env = os.environ if environ is None else environ
    use_cpu = env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if use_cpu and "MASTER_PORT" in env and "WORLD_SIZE" not in env:
        raise LaunchError(
            "`accelerate launch --cpu --num_processes N` starts a single process; on CPUs launch N "
            "processes with `torchrun --nproc_per_node N -m flowrl train CONFIG` (docs/distributed.md)"
        )


def check_trackers(log_with: list[str]) -> None:
    """Fail up front on a tracker whose package is missing (accelerate would only warn and train on)."""
    import importlib.util

    for name in log_with or []:
        package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(name, name)
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f"run.log_with lists {name}, which is not installed: pip install "
                f"'flowrl-toolkit[{name}]' (or remove it from run.log_with)"
            )
