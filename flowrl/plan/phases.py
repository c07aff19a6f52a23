"""Assembling a run on `meta` tensors and tracing its phases under `LiveMemory` (what `flowrl.plan.planner` adds up).

`Assembly` builds the run's parts as `flowrl train` builds them, after the run's own checks, with real-size networks
and no weights; `trace_rollout`, `trace_update` and `trace_step` run one chunk of each phase and return what it
allocated (`Traced`), per row, per sample or per step, for the planner to scale to the real run.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from flowrl.plan.host_values import HostCopies
from flowrl.plan.trace import LiveMemory
from flowrl.sections import HasKL


TRACE_STEPS = 3
"""Denoising steps of the traced rollout (the real count's trajectories are added by size)."""


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`."""
    sizes = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def module_bytes(module) -> int:
    return 0 if module is None else storage_bytes([*module.parameters(), *module.buffers()])


def traced_config(config, steps: int = TRACE_STEPS):
    """`config` with rollouts of `steps` stochastic steps (the traced chunk: every step's call is alike)."""
    from flowrl.image.config import HasSteps
    from flowrl.trainers.image.tempflow_grpo import TempFlowGRPOConfig
    from flowrl.trainers.shared.matching import MatchingConfig

    if isinstance(config, TempFlowGRPOConfig) or "trained_expert" in config.model.options:
        return config  # TempFlow-GRPO's group (seeds x branches x steps), Wan 2.2's experts by step: traced whole
    s = config.sampling
    draws = config.num_draws if isinstance(config, MatchingConfig) else 0  # distinct levels of the traced steps
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
    if isinstance(config, HasSteps):  # a selection that fits the traced steps (its calls are alike)
        changes["steps"] = dataclasses.replace(config.steps, k=min(config.steps.k, steps), window=None)
    return dataclasses.replace(config, **changes)


def check_launch(config, gpus: int) -> str:
    """What the run refuses at `gpus` processes (its engine's and driver's checks); returns the sharding it uses."""
    from flowrl.run.driver import check_world
    from flowrl.run.engine import check_shardable
    from flowrl.trainers import TRAINERS

    algorithm_class = TRAINERS.get(config.trainer)
    shard = config.run.shard if gpus > 1 else "none"
    refusals = [algorithm_class.shard_refusal] if algorithm_class.shard_refusal else []
    check_shardable(shard, config.run, config.optim, config.ema_decay, refusals)
    check_world(config, algorithm_class, gpus, shard)
    return shard


class Assembly:
    """The run's parts without weights: engine (CPU, one process), modality, algorithm, update scheduler, on `meta`,
    after the run's checks at `gpus` processes."""

    def __init__(self, config, gpus: int, folder):
        from flowrl.image.modality import build_image_policy
        from flowrl.run.engine import Engine
        from flowrl.run.scheduler import UpdateScheduler
        from flowrl.trainers import TRAINERS

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
            self.modality.ensure_reference(offload=isinstance(config, HasKL) and config.kl.reference_offload)
        self.algorithm.build()
        self.module = self.algorithm.trained_module()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.engine.model, self.engine.params = self.module, self.params  # what the scheduler's calls go through
        self.scheduler = UpdateScheduler(traced.batch, self.engine, self.algorithm, config.run.seed)
        self.config = config

    @property
    def policy(self):
        return self.modality.policy


@dataclasses.dataclass
class Traced:
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


def trace(mem: LiveMemory, name: str, fn) -> Traced:
    start = mem.current
    with mem.phase(name):
        fn()
    return Traced(activation=mem.phases[name].peak - start, kept=mem.current - start)


def encode(policy) -> None:
    """A batch of prompts and the negative prompt through the text encoders (padded to their fixed lengths)."""
    policy.encode([f"a prompt of the plan {i}" for i in range(policy.text_batch_size)])
    policy.encode([policy.negative_prompt], negative=True)
    policy.clear_text_cache()


@contextlib.contextmanager
def traced_by_transformers():
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


def trace_rollout(mem: LiveMemory, parts: Assembly, config):
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
    per_state = storage_bytes([chunk.latents]) / (rows * (t + 1))
    per_step = storage_bytes([chunk.log_probs, *([chunk.means] if chunk.means is not None else [])]) / (rows * t)
    per_sample = storage_bytes([chunk.images]) / rows if chunk.images is not None else 0
    kept = (steps + 1) * per_state + steps * per_step + per_sample  # one sample's at the real step count
    cfg = policy.adapter.uses_cfg(c.sampling.guidance_scale)
    calls = rows * (2 if cfg and policy.uncond_grad else 1)
    held = mem.current - start  # the chunk's own trajectories and images
    activation = max(mem.phases["rollout"].peak - start - held, 0)
    traced = Traced(activation=activation, rows=rows, calls=calls, kept_per_sample=kept, flops=flops_per_sample)
    traced.decode = max(
        out.get("decode", 0) - (held - storage_bytes([chunk.images]) if chunk.images is not None else held), 0
    )
    traced.denoise = max(out.get("denoise", mem.phases["rollout"].peak) - start - held, 0)
    return traced, chunk


def trace_update(mem: LiveMemory, parts: Assembly, chunk) -> Traced:
    """One micro-batch's forward and backward through the run's update scheduler, on the chunk's rows (two trained
    steps: every step's backward is alike; a whole backward's activations grow with its steps, added by size)."""
    from flowrl.policies.rollout import Collected
    from flowrl.run.stats import EpochStats

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
    if algorithm.auxiliary_modules():
        raise ValueError(
            f"{c.trainer} fits its auxiliary networks ({', '.join(algorithm.auxiliary_modules())}) on "
            "data in CPU memory before each update, reading their losses back: its update is not planned"
        )
    try:
        with HostCopies():  # the epoch's CPU-side data (a replay buffer) as zeros: host memory, not the GPU's
            batch, _ = algorithm.prepare(collected, advantages, torch.ones(n, dtype=torch.bool), 0)
    except NotImplementedError as err:
        if "meta tensor" not in str(err):
            raise
        raise ValueError(
            f"{c.trainer} keeps data of its update in CPU memory (a replay buffer, stored draws), "
            "which a trace on meta tensors cannot copy: its update is not planned"
        ) from None
    plan = scheduler.plan(batch, 0)
    flops = mem.flops
    traced = trace(mem, "update", lambda: scheduler.accumulate(plan, torch.arange(n), EpochStats()))
    flops = mem.flops - flops
    grads = storage_bytes([p.grad for p in parts.params if p.grad is not None])
    activation = max(traced.activation - grads, 0)
    mode, traced_columns = c.batch.backward, plan.index.shape[1]
    separable = algorithm.element_calls and not (scheduler.coupled_steps or scheduler.coupled_rows)
    columns = trained_columns(parts.config)
    per_step = mode == "per_step" or (mode == "auto" and separable and n * (columns or traced_columns) > n)
    if not per_step and columns and columns > traced_columns:  # a whole backward keeps every trained step's
        activation = activation * columns // traced_columns
    detail = f"{n} rows, backward {'per step' if per_step else 'whole'} ({mode})"
    per_sample = flops * (columns or traced_columns) / traced_columns / n  # every trained step's
    return Traced(activation=activation, rows=n, grads=grads, detail=detail, flops=per_sample)


def trained_columns(config) -> int | None:
    """The denoising steps a sample trains at the config's real step count (None: its elements are not steps)."""
    from types import SimpleNamespace

    from flowrl.core import sde_window_at
    from flowrl.image.config import HasSteps
    from flowrl.image.steps import StepTerms
    from flowrl.runtime import seeded

    if not isinstance(config, HasSteps):
        return None
    steps, s = config.steps, config.sampling
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


def trace_step(parts: Assembly) -> tuple[int, int]:
    """Bytes of AdamW's state after a step (fused on a GPU: no temporaries) and of the EMA copy."""
    optimizer = torch.optim.AdamW(parts.params, lr=1e-6, foreach=False)
    optimizer.step()
    state = storage_bytes([t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    ema = storage_bytes(parts.params) if parts.engine.ema_decay else 0
    return state, ema
