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

from flowrl.plan.trace import CudaAutocast, GiB, GpuAttention, LiveMemory


USABLE = 0.92
"""The share of a GPU's memory a plan may fill (CUDA's context and the caching allocator's fragmentation take the
rest of what the driver reports; `torch.cuda.max_memory_allocated`, what the plan predicts, stays below it)."""
TRACE_STEPS = 3
"""Denoising steps of the traced rollout (the real count's trajectories are added by size)."""


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


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`."""
    sizes = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def _module_bytes(module) -> int:
    return 0 if module is None else _bytes([*module.parameters(), *module.buffers()])


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _gathered(n: int) -> str:
    return f", two blocks gathered whole {_gib(n)}" if n else ""


def traced_config(config, steps: int = TRACE_STEPS):
    """`config` with rollouts of `steps` stochastic steps (the traced chunk: every step's call is alike)."""
    if hasattr(config, "branches") or "trained_expert" in config.model.options:
        return config  # TempFlow-GRPO's group (seeds x branches x steps), Wan 2.2's experts by step: traced whole
    s = config.sampling
    draws = getattr(config, "num_draws", 0) or 0  # flow-matching draws pick distinct levels of the traced steps
    steps = min(max(steps, draws + 2), s.num_steps)
    sampling = dataclasses.replace(
        s,
        num_steps=steps,
        sde_window=None,
        sde_window_schedule="fixed",
        window_span=None,
        window_size=min(s.window_size, max(steps - 1, 1)),
        post_window_solver="euler",
    )
    changes = {"sampling": sampling}
    if getattr(config, "steps", None) is not None:  # a selection that fits the traced steps (its calls are alike)
        changes["steps"] = dataclasses.replace(config.steps, k=min(config.steps.k, steps), window=None)
    return dataclasses.replace(config, **changes)


def check_launch(config, gpus: int) -> str:
    """What the run refuses at `gpus` processes (its engine's and driver's checks); returns the sharding it uses."""
    from flowrl.trainers.driver import check_world
    from flowrl.trainers.engine import check_shardable
    from flowrl.trainers.registry import TRAINERS

    algorithm_class = TRAINERS.get(config.trainer)
    shard = config.run.shard if gpus > 1 else "none"
    refusals = [algorithm_class.shard_refusal] if algorithm_class.shard_refusal else []
    check_shardable(shard, config.run, config.optim, config.ema_decay, refusals)
    check_world(config, algorithm_class, gpus, shard)
    return shard


class _Assembly:
    """The run's parts without weights: engine (CPU, one process), modality, algorithm, update scheduler, on `meta`,
    after the run's checks at `gpus` processes."""

    def __init__(self, config, gpus: int, folder):
        from flowrl.image.modality import build_image_policy
        from flowrl.trainers.engine import Engine
        from flowrl.trainers.registry import TRAINERS
        from flowrl.trainers.scheduler import UpdateScheduler

        algorithm_class = TRAINERS.get(config.trainer)
        if algorithm_class.modality_class.__name__ != "ImageModality":
            raise ValueError(f"flowrl plan plans image and video runs; {config.trainer} trains another modality")
        self.shard = check_launch(config, gpus)
        traced = traced_config(config)
        run = dataclasses.replace(config.run, cpu=True, log_with=[])
        self.engine = Engine(run, config.optim, folder, ema_decay=config.ema_decay, ema_every=config.ema_every)
        policy = build_image_policy(
            config.model,
            forward_batch_size=config.batch.micro_batch_size,
            weights=False,
            seed=config.run.seed,
            mixed_precision=config.run.mixed_precision,
        )
        self.modality = algorithm_class.modality_class(traced, self.engine.context(), policy=policy, scoring=False)
        self.algorithm = algorithm_class(traced, self.modality, self.engine)
        if self.algorithm.needs_reference():
            kl = getattr(config, "kl", None)
            self.modality.ensure_reference(offload=bool(kl and kl.reference_offload))
        self.algorithm.build()
        self.module = self.algorithm.trained_module()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.engine.model, self.engine.params = self.module, self.params  # what the scheduler's calls go through
        self.scheduler = UpdateScheduler(traced.batch, self.engine, self.algorithm, config.run.seed)
        self.config = config

    @property
    def policy(self):
        return self.modality.policy


def plan(config, *, gpus: int = 1, gpu_memory: float = 80.0, name: str = "") -> MemoryPlan:
    """The memory plan of `config` on `gpus` GPUs of `gpu_memory` GiB each (see the module docstring). A setting
    the run would refuse at that process count raises the run's own error."""
    return plans(config, gpus=(gpus,), gpu_memory=gpu_memory, name=name)[0]


def plans(config, *, gpus=(1,), gpu_memory: float = 80.0, name: str = "") -> list[MemoryPlan]:
    """`plan` at each process count of `gpus`, from one trace."""
    from flowrl.models.build import networks, repeated_blocks
    from flowrl.policies.text_store import text_encoders

    for count in gpus:
        check_launch(config, count)
    with tempfile.TemporaryDirectory() as folder:
        parts = _Assembly(config, 1, folder)
    policy, c = parts.policy, config
    modules = {k: m for k, m in policy.adapter.pipeline.components.items() if isinstance(m, torch.nn.Module)}
    encoders = set(text_encoders(policy.adapter.pipeline))
    offloaded = policy.text_encoders_offloaded
    policy.text_encoders_offloaded = False  # nothing moves on meta: offloaded encoders join the phase by size
    trained_ids = {id(net) for _, net in networks(policy.model)}  # what `run.shard` shards (a frozen expert stays)
    trained = {k for k, m in modules.items() if id(m) in trained_ids}
    weights = {k: _module_bytes(m) for k, m in modules.items()}
    if policy.reference_model is not None and not policy.reference_offload:
        weights["reference copy"] = _module_bytes(policy.reference_model)
    resident = {k: v for k, v in weights.items() if not (offloaded and k in encoders)}
    mem = LiveMemory()
    mem.register([t for k, m in modules.items() if k in resident for t in (*m.parameters(), *m.buffers())])
    if "reference copy" in resident:
        mem.register([*policy.reference_model.parameters(), *policy.reference_model.buffers()])
    low = torch.float16 if c.run.mixed_precision == "fp16" else torch.bfloat16
    precision = CudaAutocast(low) if c.run.mixed_precision != "no" else contextlib.nullcontext()
    # the backward on this thread (the modes are thread-local; a checkpointed block's recomputation must see them)
    single = torch.autograd.set_multithreading_enabled(False)
    with mem, GpuAttention(), precision, _traced_by_transformers(), single:
        text = _trace(mem, "text", lambda: _encode(policy))
        rollout, chunk = _rollout(mem, parts, c)
        update = _update(mem, parts, chunk)
        state, ema = _step(parts)
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
        gathered = 2 * max((_module_bytes(b) for b in blocks), default=0) if sharded_net else 0
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


@dataclasses.dataclass
class _Traced:
    activation: int = 0
    """The transient peak above what the phase started with and keeps."""
    kept: int = 0
    rows: int = 0
    calls: int = 0
    grads: int = 0
    detail: str = ""
    denoise: int = 0
    """Rollout: the network calls' peak (the decoder's is `decode`)."""
    decode: int = 0
    flops: float = 0.0
    """FLOPs per sample executed (`FlopCounterMode`: matrix products, convolutions, attention) at the real steps."""
    kept_per_sample: float = 0.0
    """Rollout: one sample's trajectory, log-probs, means and images at the real step count."""


def _trace(mem: LiveMemory, name: str, fn) -> _Traced:
    start = mem.current
    with mem.phase(name):
        fn()
    return _Traced(activation=mem.phases[name].peak - start, kept=mem.current - start)


def _encode(policy) -> None:
    """A batch of prompts and the negative prompt through the text encoders (padded to their fixed lengths)."""
    policy.encode([f"a prompt of the plan {i}" for i in range(policy.text_batch_size)])
    policy.encode([policy.negative_prompt], negative=True)
    policy.clear_text_cache()


@contextlib.contextmanager
def _traced_by_transformers():
    """transformers' text encoders read their padding masks to skip them when nothing is padded (`mask.all()`), which a
    `meta` tensor cannot answer; under a tracer (`torch.compile`, FakeTensor) they keep the masks instead: the plan
    says it traces, and plans the memory of the masked case."""
    from transformers import masking_utils

    original = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: True
    try:
        yield
    finally:
        masking_utils.is_tracing = original


def _rollout(mem: LiveMemory, parts: _Assembly, config):
    """One chunk of rows sampled through the algorithm's sampler (`TRACE_STEPS` steps), its decoding traced apart;
    this process's share of the epoch's rollout at the real step count is added by the size of what the chunk kept
    per sample and step."""
    from flowrl import prompts as prompt_sets
    from flowrl.runtime import seeded

    c, policy = config, parts.policy
    rows = c.sampling.forward_batch_size or c.batch.micro_batch_size
    train = prompt_sets.load(c.prompts.train)  # the run's own prompts (editing, image-to-video: with their images)
    chosen = [train[(i // c.prompts.group_size) % len(train)] for i in range(rows)]
    texts, sources = [str(p) for p in chosen], prompt_sets.source_images(chosen)
    extra = {} if sources is None else {"sources": sources}
    generators = [seeded(c.run.seed, 0, 1, i) for i in range(rows)]
    sampler = parts.algorithm.sampler()
    out, decode = {}, policy.decode

    def traced_decode(*args, **kwargs):  # the decoder's own phase, inside the rollout's
        out["denoise"] = mem.phases["rollout"].peak  # the network calls' peak, before the decoder runs
        start, before = mem.current, mem.flops
        with mem.phase("decode"):
            images = decode(*args, **kwargs)
        out["decode"] = mem.phases["decode"].peak - start
        out["decode_flops"] = mem.flops - before
        return images

    policy.decode = traced_decode
    start, flops = mem.current, mem.flops
    try:
        with mem.phase("rollout"):
            out["rollout"] = sampler(texts, generators, list(range(rows)), 0, **extra)
    finally:
        del policy.decode
    chunk = out["rollout"]
    t, steps = chunk.num_steps, c.sampling.num_steps
    decode_flops = out.get("decode_flops", 0)
    network_flops = mem.flops - flops - decode_flops  # the calls of `t` steps: each step's alike
    flops_per_sample = (network_flops * steps / t + decode_flops) / rows
    per_state = _bytes([chunk.latents]) / (rows * (t + 1))
    per_step = _bytes([chunk.log_probs, *([chunk.means] if chunk.means is not None else [])]) / (rows * t)
    per_sample = _bytes([chunk.images]) / rows if chunk.images is not None else 0
    kept = (steps + 1) * per_state + steps * per_step + per_sample  # one sample's at the real step count
    cfg = policy.adapter.uses_cfg(c.sampling.guidance_scale)
    calls = rows * (2 if cfg and policy.uncond_grad else 1)
    held = mem.current - start  # the chunk's own trajectories and images
    activation = max(mem.phases["rollout"].peak - start - held, 0)
    traced = _Traced(activation=activation, rows=rows, calls=calls, kept_per_sample=kept, flops=flops_per_sample)
    traced.decode = max(
        out.get("decode", 0) - (held - _bytes([chunk.images]) if chunk.images is not None else held), 0
    )
    traced.denoise = max(out.get("denoise", mem.phases["rollout"].peak) - start - held, 0)
    return traced, chunk


def _update(mem: LiveMemory, parts: _Assembly, chunk) -> _Traced:
    """One micro-batch's forward and backward through the run's update scheduler, on the chunk's rows (two trained
    steps: every step's backward is alike; a whole backward's activations grow with its steps, added by size)."""
    from flowrl.policies.rollout import Collected
    from flowrl.trainers.stats import EpochStats

    algorithm, scheduler, c = parts.algorithm, parts.scheduler, parts.algorithm.config
    n = min(len(chunk), c.batch.micro_batch_size)
    part = chunk.select(torch.arange(n))
    collected = Collected(
        data=part,
        rows=torch.arange(n),
        size=n,
        prompts=list(part.prompts),
        total=torch.zeros(n),
        group_ids=part.group_ids.cpu(),
    )
    advantages = torch.linspace(-1.0, 1.0, n)
    try:
        batch, _ = algorithm.prepare(collected, advantages, torch.ones(n, dtype=torch.bool), 0)
    except NotImplementedError as err:
        if "meta tensor" not in str(err):
            raise
        raise ValueError(
            f"flowrl plan: {c.trainer} keeps data of its update in CPU memory (a replay buffer, stored draws), "
            "which a trace on meta tensors cannot copy: its update is not planned"
        ) from None
    plan = scheduler.plan(batch, 0)
    flops = mem.flops
    traced = _trace(mem, "update", lambda: scheduler.accumulate(plan, torch.arange(n), EpochStats()))
    flops = mem.flops - flops
    grads = _bytes([p.grad for p in parts.params if p.grad is not None])
    activation = max(traced.activation - grads, 0)
    mode, traced_columns = c.batch.backward, plan.index.shape[1]
    separable = algorithm.element_calls and not (scheduler.coupled_steps or scheduler.coupled_rows)
    columns = _columns(parts.config)
    per_step = mode == "per_step" or (mode == "auto" and separable and n * (columns or traced_columns) > n)
    if not per_step and columns and columns > traced_columns:  # a whole backward keeps every trained step's
        activation = activation * columns // traced_columns
    detail = f"{n} rows, backward {'per step' if per_step else 'whole'} ({mode})"
    per_sample = flops * (columns or traced_columns) / traced_columns / n  # every trained step's
    return _Traced(activation=activation, rows=n, grads=grads, detail=detail, flops=per_sample)


def _columns(config) -> int | None:
    """The denoising steps a sample trains at the config's real step count (None: its elements are not steps)."""
    from types import SimpleNamespace

    from flowrl.core import sde_window_at
    from flowrl.image.steps import StepTerms
    from flowrl.runtime import seeded

    steps, s = getattr(config, "steps", None), config.sampling
    if steps is None:
        return None
    if steps.selection == "random":
        return steps.k
    window = sde_window_at(
        s.sde_window_schedule,
        0,
        s.num_steps,
        window=s.sde_window,
        size=s.window_size,
        every=s.window_every,
        stride=s.window_stride,
        span=s.window_span,
        generator=seeded(config.run.seed, 0, 7),
    )
    start, end = window or (0, s.num_steps)
    skeleton = SimpleNamespace(sde_steps=torch.arange(start, end))
    return len(StepTerms(None, steps, None, store_means=False, seed=config.run.seed).trainable_steps(skeleton))


def _step(parts: _Assembly) -> tuple[int, int]:
    """Bytes of AdamW's state after a step (fused on a GPU: no temporaries) and of the EMA copy."""
    optimizer = torch.optim.AdamW(parts.params, lr=1e-6, foreach=False)
    optimizer.step()
    state = _bytes([t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    ema = _bytes(parts.params) if parts.engine.ema_decay else 0
    return state, ema
