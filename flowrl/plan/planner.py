"""A run's GPU memory per phase, traced before the run: `flowrl plan` and the check `flowrl train` runs first.

The run is assembled as `flowrl train` assembles it (the same config checks at the process count asked for; the
policy built by the modality with its LoRA, checkpointing, offloading and precision settings; the algorithm with its
sampler, steps and update scheduler), but its networks are real-size modules on the `meta` device, built from the
checkpoint's published architecture (`flowrl.models.published`) or a folder's own configs, and the phases run on
them under `LiveMemory` with CUDA's autocast and attention kernels replayed (`flowrl.plan.trace`): nothing is
allocated, no weight is read.

What is traced: a batch of prompts through the text encoders, one chunk of rows sampled for `TRACE_STEPS` denoising
steps (every step's call is alike: its activations are the rollout's) and one micro-batch's forward and backward
through the run's own update scheduler (its backward mode, KL, step terms) on two trained steps, then an AdamW step.
What is added by size: this process's share of the epoch's rollout at the real step count (the update holds it), the
whole backward's other trained steps, and `run.shard`'s division of the weights, gradients, optimizer state and EMA
over the GPUs (FSDP2 and ZeRO-3 gather two blocks at a time: one in use, one prefetched).

Phases (per GPU, at steady state: AdamW's state and the EMA exist from the first step on): `load` (what stays on
the GPU), `text encoding`, `rollout`, `update` and `optimizer step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile

import torch

from flowrl.plan.host_values import HostValues
from flowrl.plan.phases import (
    Assembly,
    check_launch,
    encode,
    module_bytes,
    trace,
    trace_rollout,
    trace_step,
    trace_update,
    traced_by_transformers,
)
from flowrl.plan.trace import CudaAutocast, GiB, GpuAttention, LiveMemory


USABLE = 0.92
"""The share of a GPU's memory a plan may fill (CUDA's context and the caching allocator's fragmentation take the
rest of what the driver reports; `torch.cuda.max_memory_allocated`, what the plan predicts, stays below it)."""


@dataclasses.dataclass
class PhasePeak:
    name: str
    bytes: int
    """The phase's peak per GPU."""
    detail: str = ""


@dataclasses.dataclass
class MemoryPlan:
    """A run's memory per GPU, phase by phase (see the module docstring)."""

    config: str
    gpus: int
    gpu_memory: float
    """GiB per GPU."""
    phases: list[PhasePeak]
    micro_batch_size: int
    max_micro_batch: int | None
    """The largest `batch.micro_batch_size` whose rollout and update fit (None: not even 1)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    flops: dict[str, float] = dataclasses.field(default_factory=dict)
    """FLOPs executed per sample: `rollout` (its network calls at the real step count and its decoding) and `update`
    (the forward and backward of every trained step, with the KL's reference pass)."""

    @property
    def budget(self) -> float:
        return self.gpu_memory * GiB * USABLE

    @property
    def peak(self) -> PhasePeak:
        return max(self.phases, key=lambda p: p.bytes)

    def fits(self) -> bool:
        return self.peak.bytes <= self.budget

    def refusal(self) -> str | None:
        """One line naming the setting to change, or None when the run fits."""
        if self.fits():
            return None
        peak = self.peak
        need = (
            f"the {peak.name} phase needs {peak.bytes / GiB:.1f} GiB per GPU, more than {USABLE:.0%} of "
            f"{self.gpu_memory:g} GiB"
        )
        if self.max_micro_batch and self.max_micro_batch < self.micro_batch_size:
            return f"{need}: set batch.micro_batch_size <= {self.max_micro_batch} (now {self.micro_batch_size})"
        return (
            f"{need}: set model.gradient_checkpointing: true, model.offload_text_encoders: true, or run.shard: "
            "fsdp2 over more GPUs (`flowrl plan CONFIG --gpus N` shows each)"
        )

    def table(self) -> str:
        lines = [
            f"{self.config} on {self.gpus} GPU{'s' if self.gpus > 1 else ''} of {self.gpu_memory:g} GiB (a plan fits "
            f"in {USABLE:.0%}: {self.budget / GiB:.1f} GiB)",
            "",
            "| phase | GiB per GPU | what |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {p.name} | {p.bytes / GiB:.1f} | {p.detail} |" for p in self.phases]
        verdict = "fits" if self.fits() else f"does NOT fit: {self.refusal()}"
        most = "none" if self.max_micro_batch is None else str(self.max_micro_batch)
        lines += ["", f"{verdict}; largest batch.micro_batch_size that fits: {most} (now {self.micro_batch_size})"]
        if self.flops:
            lines.append("FLOPs per sample: " + ", ".join(f"{k} {v / 1e12:.2f} TFLOP" for k, v in self.flops.items()))
        return "\n".join(lines + self.notes)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _gathered(n: int) -> str:
    return f", two blocks gathered whole {_gib(n)}" if n else ""


def plan(config, *, gpus: int = 1, gpu_memory: float = 80.0, name: str = "") -> MemoryPlan:
    """The memory plan of `config` on `gpus` GPUs of `gpu_memory` GiB each (see the module docstring). A setting
    the run would refuse at that process count raises the run's own error."""
    return plans(config, gpus=(gpus,), gpu_memory=gpu_memory, name=name)[0]


def plans(config, *, gpus=(1,), gpu_memory: float = 80.0, name: str = "") -> list[MemoryPlan]:
    """`plan` at each process count of `gpus`, from one trace."""
    from flowrl.policies.build import networks, repeated_blocks
    from flowrl.policies.text_store import text_encoders

    for count in gpus:
        check_launch(config, count)
    with tempfile.TemporaryDirectory() as folder:
        parts = Assembly(config, 1, folder)
    policy, c = parts.policy, config
    modules = {k: m for k, m in policy.adapter.pipeline.components.items() if isinstance(m, torch.nn.Module)}
    encoders = set(text_encoders(policy.adapter.pipeline))
    offloaded = policy.text_encoders_offloaded
    policy.text_encoders_offloaded = False  # nothing moves on meta: offloaded encoders join the phase by size
    trained_ids = {id(net) for _, net in networks(policy.model)}  # what `run.shard` shards (a frozen expert stays)
    trained = {k for k, m in modules.items() if id(m) in trained_ids}
    weights = {k: module_bytes(m) for k, m in modules.items()}
    if policy.reference_model is not None and not policy.reference_offload:
        weights["reference copy"] = module_bytes(policy.reference_model)
    resident = {k: v for k, v in weights.items() if not (offloaded and k in encoders)}
    mem = LiveMemory()
    mem.register([t for k, m in modules.items() if k in resident for t in (*m.parameters(), *m.buffers())])
    if "reference copy" in resident:
        mem.register([*policy.reference_model.parameters(), *policy.reference_model.buffers()])
    low = torch.float16 if c.run.mixed_precision == "fp16" else torch.bfloat16
    precision = CudaAutocast(low) if c.run.mixed_precision != "no" else contextlib.nullcontext()
    # the backward on this thread (the modes are thread-local; a checkpointed block's recomputation must see them)
    single = torch.autograd.set_multithreading_enabled(False)
    with mem, GpuAttention(), precision, HostValues(), traced_by_transformers(), single:
        text = trace(mem, "text", lambda: encode(policy))
        rollout, chunk = trace_rollout(mem, parts, c)
        update = trace_update(mem, parts, chunk)
        state, ema = trace_step(parts)
    blocks = [b for _, net in networks(policy.model) for b in repeated_blocks(net)]
    results = []
    for n in gpus:
        shard = config.run.shard if n > 1 else "none"
        local = math.ceil(c.prompts.prompts_per_epoch * c.prompts.group_size / n)  # this process's samples
        kept = int(rollout.kept_per_sample * local)
        kept_detail = f"{local} samples' trajectories of {c.sampling.num_steps} steps kept ({_gib(kept)})"
        sharded_net = shard in ("fsdp2", "zero3")
        per_gpu = {k: (v // n if sharded_net and k in trained else v) for k, v in resident.items()}
        optimizer = state // n if shard != "none" else state
        ema_bytes = ema // n if shard == "fsdp2" else ema
        grads = update.grads // n if shard != "none" else update.grads * (2 if n > 1 else 1)  # DDP: its buckets too
        gathered = 2 * max((module_bytes(b) for b in blocks), default=0) if sharded_net else 0
        load = sum(per_gpu.values()) + optimizer + ema_bytes
        encoder_bytes = sum(weights[k] for k in encoders)
        state_detail = f"AdamW state {_gib(optimizer)}" + (f", EMA {_gib(ema_bytes)}" if ema_bytes else "")
        phases = [
            PhasePeak("load", load, ", ".join(f"{k} {_gib(v)}" for k, v in per_gpu.items()) + f"; {state_detail}"),
            PhasePeak(
                "text encoding",
                encoder_bytes + text.activation if offloaded else load + text.activation,
                f"text encoders {_gib(encoder_bytes)}, "
                + (
                    "alone on the GPU: the prompts are encoded before the network moves there, "
                    if offloaded
                    else "resident, "
                )
                + f"{policy.text_batch_size} prompts per call",
            ),
            PhasePeak(
                "rollout",
                load + kept + rollout.denoise + gathered,
                f"{rollout.calls} rows per call, {kept_detail}{_gathered(gathered)}",
            ),
            PhasePeak("decode", load + kept + rollout.decode, f"{rollout.rows} samples per decoder call"),
            PhasePeak(
                "update",
                load + kept + grads + update.activation + gathered,
                f"{update.detail}, gradients {_gib(grads)}, the rollout {_gib(kept)}{_gathered(gathered)}",
            ),
            PhasePeak("optimizer step", load + grads, f"gradients {_gib(grads)}; {state_detail}"),
        ]
        fixed = [
            phases[2].bytes - rollout.denoise,
            phases[3].bytes - rollout.decode,
            phases[4].bytes - update.activation,
        ]
        follows = not c.sampling.forward_batch_size  # rollout calls of the micro-batch's size
        rows = [
            rollout.denoise / rollout.rows if follows else 0.0,
            rollout.decode / rollout.rows if follows else 0.0,
            update.activation / max(update.rows, 1),
        ]
        budget = USABLE * gpu_memory * GiB
        limits = [math.floor((budget - f) / r) for f, r in zip(fixed, rows) if r > 0]
        most = min(limits) if limits else None
        notes = []
        if c.rewards:
            notes.append(f"\nNot planned: the reward models ({', '.join(r.name for r in c.rewards)}).")
        results.append(
            MemoryPlan(
                config=name or c.model.name,
                gpus=n,
                gpu_memory=gpu_memory,
                phases=phases,
                micro_batch_size=c.batch.micro_batch_size,
                max_micro_batch=most if most and most >= 1 else None,
                notes=notes,
                flops={"rollout": rollout.flops, "update": update.flops},
            )
        )
    return results
