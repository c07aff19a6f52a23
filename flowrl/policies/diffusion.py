"""`DiffusionPolicy`: a diffusers model as a policy with per-step log-probabilities.

`rollout(prompts, ...)` samples images and records every denoising transition with its log-probability;
`score(rollout, steps)` re-scores stored transitions under the current weights (or the reference's) with the
same guidance, which is what every trainer differentiates.

Exactness: a network's output for one sample can differ in the last bits with the batch it is computed in
(different GEMM shapes pick different kernels; the anchors' most reported "ratio != 1" bug). The policy
therefore runs every forward and step kernel on chunks of exactly `forward_batch_size` rows, padding the
last chunk, so every call has the same shapes: re-scoring a rollout's chunks as sampled reproduces its
log-probs bit for bit on any CPU or GPU. A sample re-scored at another position of a chunk (a shuffled
minibatch) reproduces them bit for bit where the kernels do not depend on the row position (the digits
world and the tiny SD3/Flux models on the machines tested) and to the last bits otherwise (some MKL/AVX2
kernels), far inside any clip range.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from diffusers.utils.torch_utils import randn_tensor

from flowrl.policies.adapters import CallableAdapter, ModelAdapter, adapter_for
from flowrl.policies.fpo import FPODraws
from flowrl.policies.noise import NoiseDraws
from flowrl.policies.rollout import Record, per_sample
from flowrl.policies.sde import SAMPLERS, StepOutput, ddim_step, dpm_solver_2m_step, sde_step


FLOW_SAMPLERS = ("flow_sde", "dance_sde", "cps", "cps_gaussian", "ode")
POST_WINDOW_SOLVERS = ("euler", "dpm_solver_2m")
"""How the steps after the SDE window are integrated (`DiffusionPolicy.rollout`)."""


@dataclass
class DiffusionRollout(Record):
    """Sampled trajectories with everything needed to re-score them: the image modality's `Rollout`.

    `B` samples, `T` denoising steps, latents `[C, h, w]` (Flux: packed tokens). The elements the core sees
    are the T steps: `log_probs [B, T]` with `mask [B, T]` the stochastic ones.
    """

    prompts: list[str] = per_sample()
    """The prompt of each sample."""
    prompt_ids: torch.Tensor = per_sample()
    """`[B]` index of each sample's prompt in `unique_prompts` (the group id for group advantages)."""
    latents: torch.Tensor = per_sample()
    """`[B, T + 1, ...]` states `x_0` (noise) ... `x_T` in the model's dtype and layout (`[C, h, w]`; Flux:
    packed tokens `[h*w/4, 4C]`)."""
    log_probs: torch.Tensor = per_sample()
    """`[B, T]` fp32 log-probability of each transition under the behaviour policy (0 on deterministic steps)."""
    unique_prompts: list[str] = field(default_factory=list)
    """Distinct prompts in order of first appearance."""
    sampler: str = "flow_sde"
    """The step kernel (`flowrl.policies.sde`) and its settings: the rollout's sampling recipe."""
    noise_level: float = 0.0
    guidance_scale: float = 1.0
    forward_batch_size: int = 1
    """Rows per network forward at rollout; re-scoring uses the same so log-probs reproduce exactly."""
    reduce: str = "mean"
    height: int = 0
    width: int = 0
    sde_mask: torch.Tensor | None = None
    """`[T]` bool: the steps that were stochastic (the trainable ones)."""
    timesteps: torch.Tensor | None = None
    """`[T]` timesteps as the network saw them."""
    sigmas: torch.Tensor | None = None
    """`[T + 1]` flow-matching noise levels (for DDIM: the noise level with the same signal-to-noise ratio)."""
    stds: torch.Tensor | None = None
    """`[T]` std of each step's Gaussian (0 on deterministic steps)."""
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    """Conditioning of `unique_prompts` (`[P, ...]` each)."""
    null_cond: dict[str, torch.Tensor] | None = None
    """Conditioning of the negative prompt (`[1, ...]`) when classifier-free guidance is on."""
    static: dict = field(default_factory=dict)
    """Size-dependent network inputs (Flux's image ids)."""
    images: torch.Tensor | None = per_sample(default=None)
    """`[B, 3, H, W]` decoded images in [0, 1]."""
    means: torch.Tensor | None = per_sample(default=None)
    """`[B, T, ...]` fp32 behaviour-policy means of each step (`store_means=True`; GRPO-Guard needs them)."""
    noise: NoiseDraws | None = per_sample(default=None)
    """FIND: the initial noise drawn from the noise policy, its conditions and behaviour log-probabilities."""
    draws: FPODraws | None = per_sample(default=None)
    """Conditional flow-matching draws `(tau, eps)` per sample (AC-Flow; FPO also keeps the behaviour losses)."""
    stochastic_step: torch.Tensor | None = per_sample(default=None)
    """`[B]` the one stochastic step of each sample when samples branch at different steps (TempFlow-GRPO); then
    `sde_mask` is the union over the samples. None: `sde_mask` holds for every sample."""

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def sde_steps(self) -> torch.Tensor:
        """Indices of the stochastic steps."""
        return self.sde_mask.nonzero().flatten()

    @property
    def mask(self) -> torch.Tensor:
        """`[B, T]` bool: the stochastic steps of every sample."""
        if self.stochastic_step is not None:
            return torch.nn.functional.one_hot(self.stochastic_step, self.num_steps).bool()
        return self.sde_mask.unsqueeze(0).expand(len(self), -1)

    @property
    def group_ids(self) -> torch.Tensor:
        """`[B]` the prompt of each sample (its index in `unique_prompts`)."""
        return self.prompt_ids

    @classmethod
    def cat(cls, parts: Sequence[DiffusionRollout]) -> DiffusionRollout:
        """One rollout from `parts` sampled with the same settings (an epoch sampled in parts, in order).

        Per-sample fields are concatenated; each distinct prompt keeps the conditioning of its first part.
        """
        parts = list(parts)
        joined = super().cat(parts, shared_from_first=("unique_prompts", "cond", "prompt_ids"))
        unique = list(dict.fromkeys(joined.prompts))
        position = {p: i for i, p in enumerate(unique)}
        source = {}  # prompt -> (part, row in that part's cond)
        for part in parts:
            for j, p in enumerate(part.unique_prompts):
                source.setdefault(p, (part, j))
        cond = {k: torch.stack([source[p][0].cond[k][source[p][1]] for p in unique]) for k in parts[0].cond}
        ids = torch.tensor([position[p] for p in joined.prompts])
        return replace(joined, prompt_ids=ids, unique_prompts=unique, cond=cond)

    def to_transitions(self, rows: torch.Tensor, steps: torch.Tensor) -> Transitions:
        """The single steps `x_t -> x_{t+1}` of samples `rows [n]` at steps `steps [n]` (a replay buffer's view).

        `prompts` of the transitions are the samples' prompt texts' indices in `unique_prompts`.
        """
        dev = self.latents.device
        r, s = rows.to(dev), steps.to(dev)
        return Transitions(states=self.latents[r, s], next_states=self.latents[r, s + 1], steps=steps.cpu(),
                           prompts=self.prompt_ids[rows.to(self.prompt_ids.device)].cpu(),
                           log_probs=self.log_probs[r, s].float().cpu(), rewards=torch.zeros(len(rows)))  # fmt: skip


@dataclass
class Transitions(Record):
    """`n` single denoising steps `x_t -> x_{t+1}` with what re-scoring and learning from them needs (DPOK's
    replay buffer holds these; `DiffusionRollout.to_transitions` makes them)."""

    states: torch.Tensor = per_sample()
    """`[n, ...]` states `x_t` (the model's dtype and latent layout)."""
    next_states: torch.Tensor = per_sample()
    """`[n, ...]` the sampled next states `x_{t+1}`."""
    steps: torch.Tensor = per_sample()
    """`[n]` step indices t (long)."""
    prompts: torch.Tensor = per_sample()
    """`[n]` prompt indices (into a table the owner keeps)."""
    log_probs: torch.Tensor = per_sample()
    """`[n]` fp32 behaviour log-probabilities `log p_old(x_{t+1} | x_t, c)`."""
    rewards: torch.Tensor = per_sample()
    """`[n]` fp32 return of the trajectory the step belongs to (the reward or its advantage)."""


@dataclass
class _Chunk:
    rows: torch.Tensor | None
    """Row indices (padded to the chunk size), or `None` when the chunk is the whole batch in order."""
    real: int
    """How many of the rows are real (the rest is padding)."""
    cond: dict
    """The chunk's conditioning, with the unconditional branch prepended under CFG."""


class DiffusionPolicy:
    """A text-to-image diffusion / flow model as a policy over denoising steps.

    Args:
        adapter (`ModelAdapter`): how to call the model family (`flowrl.policies.adapters`); use
            `DiffusionPolicy.from_pipeline(pipe)` for SD3/3.5, Flux.1 and SD1.x/2.x pipelines.
        forward_batch_size (`int`, *optional*): rows per network forward. `None` uses the rollout's batch
            size. Rollouts and re-scoring use the same chunking, padded, so log-probs reproduce exactly.
        reduce (`str`, defaults to `"mean"`): log-prob reduction over latent elements (`"mean"` or `"sum"`).
        negative_prompt (`str`, defaults to `""`): the unconditional branch of classifier-free guidance.
        text_batch_size (`int`, defaults to 8): prompts per text-encoder call (fixed and padded, so an
            embedding never depends on its batch).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        forward_batch_size: int | None = None,
        reduce: str = "mean",
        negative_prompt: str = "",
        text_batch_size: int = 8,
    ):
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if forward_batch_size is not None and forward_batch_size < 1:
            raise ValueError(f"forward_batch_size must be >= 1, got {forward_batch_size}")
        self.adapter = adapter
        self.forward_batch_size = forward_batch_size
        self.reduce = reduce
        self.negative_prompt = negative_prompt
        self.text_batch_size = text_batch_size
        self.reference_model: torch.nn.Module | None = None
        self.reference_offload = False  # the reference copy lives in CPU memory between its passes
        self.forward_module: torch.nn.Module | None = None
        """What training forwards call (a trainer sets the accelerate/DDP-prepared module); default `model`."""
        self._text_cache: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def from_pipeline(cls, pipeline, *, max_sequence_length: int | None = None, **kwargs) -> DiffusionPolicy:
        """Wrap a `StableDiffusion3Pipeline`, `FluxPipeline` or `StableDiffusionPipeline` (components shared)."""
        return cls(adapter_for(pipeline, max_sequence_length=max_sequence_length), **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype=torch.float32, device="cpu", family=None,
                        max_sequence_length: int | None = None, **kwargs) -> DiffusionPolicy:  # fmt: skip
        """Load a pipeline from a hub id or local folder (see `flowrl.models.load_pipeline`) and wrap it."""
        from flowrl.models.loaders import load_pipeline

        pipe = load_pipeline(name_or_path, dtype=dtype, device=device, family=family)
        return cls.from_pipeline(pipe, max_sequence_length=max_sequence_length, **kwargs)

    # ------------------------------------------------------------------------------------------
    # model access
    # ------------------------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The trainable network (transformer or UNet)."""
        return self.adapter.model

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.model, "peft_config", None))

    def add_lora(
        self, rank: int = 32, alpha: float | None = None, target_modules: Sequence[str] | None = None,
        dropout: float = 0.0, init: str | bool = "gaussian",
    ) -> None:  # fmt: skip
        """Freeze the network and add a peft LoRA adapter (only its weights train).

        `target_modules` default to the family's (`ModelAdapter.lora_targets`; SD3/Flux: Flow-GRPO's attention
        projections of both streams). `alpha` defaults to `rank` (scale 1; Flow-GRPO uses rank 32, alpha 64);
        `init="gaussian"` keeps the adapter's output zero at first, so the policy starts exactly at the base.
        """
        from peft import LoraConfig

        targets = list(target_modules or self.adapter.lora_targets)
        modules = dict(self.model.named_modules())
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in modules)]
        if missing:  # peft would fail deep inside, or (for some targets) silently adapt nothing
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
            raise ValueError(f"model.lora_targets {missing} match no module of the {type(self.model).__name__}; "
                             f"its linear layers are named {', '.join(leaves[:20])}")  # fmt: skip
        config = LoraConfig(r=rank, lora_alpha=alpha or rank, lora_dropout=dropout, init_lora_weights=init,
                            target_modules=targets)  # fmt: skip
        self.model.requires_grad_(False)
        self.model.add_adapter(config)

    def _pipeline_class(self):
        if self.adapter.pipeline is None:
            raise ValueError("saving LoRA in the diffusers format needs a pipeline-based policy")
        return type(self.adapter.pipeline)

    def save_lora(self, directory: str | Path) -> Path:
        """Write the adapter as `pytorch_lora_weights.safetensors`, loadable by `pipe.load_lora_weights(dir)`."""
        from peft.utils import get_peft_model_state_dict

        if not self.has_lora:
            raise ValueError("this policy has no LoRA adapter to save (call add_lora first)")
        state = get_peft_model_state_dict(self.model)
        metadata = self.model.peft_config["default"].to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        key = self.adapter.lora_prefix
        self._pipeline_class().save_lora_weights(
            str(directory), **{f"{key}_lora_layers": state, f"{key}_lora_adapter_metadata": metadata}
        )
        return Path(directory) / "pytorch_lora_weights.safetensors"

    def load_lora(self, directory: str | Path) -> None:
        """Load an adapter saved by `save_lora` (or any diffusers-format LoRA for this family) and train it."""
        path = Path(directory)
        if not (path / "pytorch_lora_weights.safetensors").is_file():
            raise FileNotFoundError(f"no pytorch_lora_weights.safetensors in {path}")
        if self.has_lora:
            self.model.delete_adapters("default")
        self.model.requires_grad_(False)
        prefix = self.adapter.lora_prefix
        self.model.load_lora_adapter(
            str(path), weight_name="pytorch_lora_weights.safetensors", prefix=prefix, adapter_name="default"
        )
        for name, param in self.model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(True)

    def freeze_reference(self, offload: bool = False) -> None:
        """Keep a frozen copy of the current network as the KL reference (for full fine-tuning); `offload` keeps it
        in CPU memory between its passes (`reference` brings it to the device for each)."""
        self.reference_model = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.reference_offload = offload
        if offload:
            self.reference_model.to("cpu")

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """Run the reference policy inside the block: the frozen copy, or the network with LoRA disabled."""
        if self.reference_model is not None:
            offload = self.reference_offload
            if offload:
                self.reference_model.to(self.device)
            try:
                yield self.reference_model
            finally:
                if offload:
                    self.reference_model.to("cpu")
        elif self.has_lora:
            self.model.disable_adapters()
            try:
                yield self.model
            finally:
                self.model.enable_adapters()
        else:
            raise ValueError("no reference policy: add a LoRA adapter or call freeze_reference() first")

    # ------------------------------------------------------------------------------------------
    # conditioning
    # ------------------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Conditioning `[len(prompts), ...]`, each distinct prompt encoded once and cached.

        Missing prompts are encoded in batches of exactly `text_batch_size` (the last one padded), so a prompt's
        embedding never depends on what it was batched with (resumed runs re-encode the same bits).
        """
        missing = list(dict.fromkeys(p for p in prompts if p not in self._text_cache))
        with torch.no_grad():
            size = self.text_batch_size
            for start in range(0, len(missing), size):
                batch = missing[start : start + size]
                out = self.adapter.encode(batch + [batch[0]] * (size - len(batch)))
                for i, prompt in enumerate(batch):
                    self._text_cache[prompt] = {k: v[i] for k, v in out.items()}
        return {k: torch.stack([self._text_cache[p][k] for p in prompts]) for k in self._text_cache[prompts[0]]}

    def clear_text_cache(self) -> None:
        self._text_cache.clear()

    # ------------------------------------------------------------------------------------------
    # the network call and the step kernel, on fixed-size chunks
    # ------------------------------------------------------------------------------------------

    def _plan(self, n: int, size: int, cond: dict, null_cond: dict | None) -> list[_Chunk]:
        """Split `n` rows into chunks of exactly `size` rows (the last one padded with copies of its first row),
        with each chunk's conditioning gathered and, under CFG, the unconditional branch prepended once."""
        plan = []
        for start in range(0, n, size):
            rows = torch.arange(start, min(start + size, n))
            real = len(rows)
            if real < size:
                rows = torch.cat([rows, rows[:1].expand(size - real)])
            whole = real == n == size  # one full chunk: use the tensors as they are, no gathers
            chunk_cond = cond if whole else {k: v[rows.to(v.device)] for k, v in cond.items()}
            if null_cond is not None:
                chunk_cond = {k: torch.cat([null_cond[k].expand(size, *v.shape[1:]), v])
                              for k, v in chunk_cond.items()}  # fmt: skip
            plan.append(_Chunk(None if whole else rows, real, chunk_cond))
        return plan

    def _predict(self, model, latents, timesteps, chunk_cond, cfg: bool, guidance_scale: float, static: dict):
        """One chunk-sized network call; under CFG both branches go through it as one batch."""
        if not cfg:
            return self.adapter.forward(latents, timesteps, chunk_cond, guidance_scale, model=model, static=static)
        out = self.adapter.forward(torch.cat([latents, latents]), torch.cat([timesteps, timesteps]), chunk_cond,
                                   guidance_scale, model=model, static=static)  # fmt: skip
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def _kernel(self, kind, output, step, sigmas, timesteps, sample, *, prev_sample, noise, noise_level):
        """The step kernel for `sample [n, ...]` at step indices `step [n]`."""
        if self.adapter.time_kind == "ddim":
            eta = noise_level if kind == "ddim" else 0.0
            return ddim_step(self.adapter.scheduler, output, timesteps[step], sample, eta=eta,
                             prev_sample=prev_sample, noise=noise, reduce=self.reduce)  # fmt: skip
        return sde_step(kind, output, sigmas[step], sigmas[step + 1], sample, prev_sample=prev_sample,
                        noise=noise, noise_level=noise_level, reduce=self.reduce, sigma_max=sigmas[1])  # fmt: skip

    def _run(self, model, kind, states, step, plan, *, cfg, static, sigmas, timesteps, guidance_scale,
             noise_level, prev_sample=None, noise=None, predictions: list | None = None) -> StepOutput:  # fmt: skip
        """Network call + step kernel for every row of `states` (`step [n]` step indices), chunk by chunk.

        `predictions`, when a list, receives each chunk's (CFG-combined) network output for its real rows.
        """
        outs = []
        for chunk in plan:
            rows = slice(None) if chunk.rows is None else chunk.rows.to(states.device)
            chunk_step = step if chunk.rows is None else step[chunk.rows]
            x = states[rows]
            output = self._predict(model, x, timesteps[chunk_step].to(x.device), chunk.cond, cfg, guidance_scale,
                                   static)  # fmt: skip
            if predictions is not None:
                predictions.append(output[: chunk.real])
            out = self._kernel(kind, output, chunk_step, sigmas, timesteps, x, noise_level=noise_level,
                               prev_sample=None if prev_sample is None else prev_sample[rows],
                               noise=None if noise is None else noise[rows])  # fmt: skip
            outs.append(out if chunk.rows is None else StepOutput(*(t[: chunk.real] for t in out)))
        if len(outs) == 1:
            return outs[0]
        return StepOutput(*(torch.cat(parts) for parts in zip(*outs)))

    # ------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(
        self,
        prompts: Sequence[str],
        *,
        num_steps: int = 10,
        guidance_scale: float = 4.5,
        noise_level: float = 0.7,
        sampler: str | None = None,
        sde_window: tuple[int, int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        height: int | None = None,
        width: int | None = None,
        latents: torch.Tensor | None = None,
        decode: bool = True,
        store_means: bool = False,
        progress: str | None = None,
        post_window_solver: str = "euler",
        post_window_ratio: float = 0.4,
    ) -> DiffusionRollout:
        """Sample one trajectory per prompt and record its per-step log-probabilities.

        Args:
            prompts (`Sequence[str]`): one per sample; repeat a prompt k times for a group of k.
            num_steps (`int`, defaults to 10): denoising steps T (Flow-GRPO trains with 10).
            guidance_scale (`float`, defaults to 4.5): classifier-free guidance (SD3, UNets; off at <= 1),
                or Flux's guidance embedding.
            noise_level (`float`, defaults to 0.7): the sampler's noise (`flow_sde` a, `dance_sde` eta,
                `cps` a, `ddim` eta).
            sampler (`str`, *optional*): `flow_sde` (default for flow models), `dance_sde`, `cps`,
                `cps_gaussian`, `ode`; `ddim` (default, eta = `noise_level`) or `ode` (eta 0) for UNets.
            sde_window (`tuple[int, int]`, *optional*): stochastic steps `start <= t < end`; the others are
                deterministic ODE / eta-0 DDIM steps (MixGRPO, Flow-GRPO-Fast). Default: every step.
            generator (`torch.Generator` or a list of one per prompt, *optional*): seeds the initial noise and every
                step's noise (with a list, row `i` draws from generator `i`, so a sample does not depend on the
                batch it is drawn in).
            height, width (`int`, *optional*): image size (default: the model's).
            latents (`torch.Tensor`, *optional*): initial noise `[B, C, h, w]` (e.g. from FIND's noise policy).
            decode (`bool`, defaults to `True`): decode the final latents to images.
            store_means (`bool`, defaults to `False`): keep each step's behaviour mean (GRPO-Guard).
            progress (`str`, *optional*): show a progress bar over the denoising steps with this label.
            post_window_solver (`str`, defaults to `"euler"`): the steps after `sde_window`: `euler` (the ODE on
                the same grid) or `dpm_solver_2m` (MixGRPO-Flash: the `T - end` steps re-discretised to
                `max(int((T - end + 1) * post_window_ratio), 2) - 1` and integrated with DPM-Solver++(2M); the
                rollout then has fewer steps, and its `sigmas`/`timesteps` are the grid it ran on).
            post_window_ratio (`float`, defaults to 0.4): the compression of `dpm_solver_2m` (Flash 0.4, Flash* 0.2).
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        sampler = sampler or self.adapter.default_sampler
        valid = ("ddim", "ode") if self.adapter.time_kind == "ddim" else FLOW_SAMPLERS
        if sampler not in valid:
            raise ValueError(f"sampler {sampler!r} does not fit a {self.family} model; choose from {', '.join(valid)}")
        SAMPLERS.get(sampler)
        start, end = sde_window if sde_window is not None else (0, num_steps)
        if not 0 <= start < end <= num_steps:
            raise ValueError(f"sde_window must satisfy 0 <= start < end <= num_steps={num_steps}, got {sde_window}")

        batch = len(prompts)
        chunk = self.forward_batch_size or batch
        unique = list(dict.fromkeys(prompts))
        prompt_ids = torch.tensor([unique.index(p) for p in prompts])
        cfg = self.adapter.uses_cfg(guidance_scale)
        self.encode(unique + [self.negative_prompt] if cfg else unique)  # one pass over the text encoders
        unique_cond = self.encode(unique)
        cond = {k: v[prompt_ids.to(v.device)] for k, v in unique_cond.items()}
        null_cond = self.encode([self.negative_prompt]) if cfg else None
        plan = self._plan(batch, chunk, cond, null_cond)

        default_h, default_w = self.adapter.default_size()
        height, width = height or default_h, width or default_w
        static = self.adapter.static_inputs(height, width)
        if latents is None:
            x = self.adapter.initial_latents(batch, height, width, generator)
        else:
            if latents.shape[0] != batch:
                raise ValueError(f"latents has {latents.shape[0]} rows for {batch} prompts")
            x = latents.to(device=self.device, dtype=self.dtype)
        timesteps, sigmas = self.adapter.schedule(num_steps, x.shape)
        if len(timesteps) != num_steps:
            raise ValueError(f"the scheduler produced {len(timesteps)} steps for num_steps={num_steps}")
        if post_window_solver not in POST_WINDOW_SOLVERS:
            raise ValueError(f"post_window_solver must be one of {', '.join(POST_WINDOW_SOLVERS)}, "
                             f"got {post_window_solver!r}")  # fmt: skip
        multistep = post_window_solver == "dpm_solver_2m" and end < num_steps
        if multistep:
            timesteps, sigmas = self._after_window(timesteps, sigmas, end, post_window_ratio, x.shape)
            num_steps = len(timesteps)

        stochastic = sampler != "ode" and not (sampler == "ddim" and noise_level == 0)
        sde_mask = torch.zeros(num_steps, dtype=torch.bool)
        sde_mask[start:end] = stochastic
        states, log_probs, stds, means = [x], [], [], []
        x0_prev = None  # the previous step's data prediction, for the multistep solver after the window
        for i in _steps(num_steps, progress):
            kind = sampler if sde_mask[i] else "ode"  # "ode" is eta-0 DDIM for UNets
            noise = None
            if kind != "ode":
                noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            step = torch.full((batch,), i, dtype=torch.long)
            predictions = [] if multistep and i >= end - 1 else None
            out = self._run(self.model, kind, x, step, plan, cfg=cfg, static=static, sigmas=sigmas,
                            timesteps=timesteps, guidance_scale=guidance_scale, noise_level=noise_level,
                            noise=noise, predictions=predictions)  # fmt: skip
            if predictions is not None:
                v = torch.cat(predictions)
                if i >= end:  # replaces the Euler step just computed (a few element-wise ops; the call is shared)
                    out = dpm_solver_2m_step(v, sigmas[i], sigmas[i + 1], x, x0_prev=x0_prev, sigma_prev=sigmas[i - 1])
                x0_prev = x.float() - float(sigmas[i]) * v.float()
            x = out.prev_sample
            states.append(x)
            log_probs.append(out.log_prob)
            stds.append(out.std[0])
            if store_means:
                means.append(out.mean)

        # a step whose kernel has no spread (CPS ends at s' = 0) has no density: it is deterministic, not trained
        sde_mask &= torch.stack(stds).cpu() > 0
        return DiffusionRollout(
            prompts=prompts,
            prompt_ids=prompt_ids,
            unique_prompts=unique,
            latents=torch.stack(states, dim=1),
            log_probs=torch.stack(log_probs, dim=1),
            sde_mask=sde_mask,
            timesteps=timesteps,
            sigmas=sigmas,
            stds=torch.stack(stds).cpu(),
            cond=unique_cond,
            null_cond=null_cond,
            sampler=sampler,
            noise_level=noise_level,
            guidance_scale=guidance_scale,
            forward_batch_size=chunk,
            reduce=self.reduce,
            height=height,
            width=width,
            static=static,
            images=self.adapter.decode(x, height, width) if decode else None,
            means=torch.stack(means, dim=1) if store_means else None,
        )

    def _after_window(self, timesteps, sigmas, end: int, ratio: float, latent_shape):
        """MixGRPO-Flash's grid: the first `end` steps as scheduled, then `sigmas[end] -> 0` in
        `max(int((T - end + 1) * ratio), 2) - 1` steps uniform in unshifted time (`ModelAdapter.resample_sigmas`;
        MixGRPO keeps `int((T - end + 1) * ratio)` points, which never reach 0 when that is 1)."""
        if not 0 < ratio <= 1:
            raise ValueError(f"post_window_ratio must be in (0, 1], got {ratio}")
        num_steps = len(timesteps)
        intervals = max(int((num_steps - end + 1) * ratio), 2) - 1
        post = self.adapter.resample_sigmas(float(sigmas[end]), intervals, latent_shape).to(sigmas)
        scale = self.adapter.scheduler.config.num_train_timesteps  # flow timesteps are sigma * 1000
        post_t = (post[:-1] * scale).to(device=timesteps.device, dtype=timesteps.dtype)
        return torch.cat([timesteps[:end], post_t]), torch.cat([sigmas[:end], post])

    # ------------------------------------------------------------------------------------------
    # re-scoring
    # ------------------------------------------------------------------------------------------

    def score(self, rollout: DiffusionRollout, steps, *, reference: bool = False) -> StepOutput:
        """Re-score stored transitions `x_t -> x_{t+1}` under the current weights (or the reference's).

        Args:
            rollout (`DiffusionRollout`): from `rollout()` (possibly `select`-ed).
            steps: step indices: an `int` (that step for every sample), `[B]` (one step per sample) or
                `[B, k]` (k steps per sample). Each must be a stochastic step of the rollout.
            reference (`bool`, defaults to `False`): score under the reference policy (no gradient).

        Returns:
            `StepOutput` with `log_prob [B, k]`, `mean [B, k, C, h, w]`, `std [B, k]` and the stored next
            states as `prev_sample`; `log_prob` and `mean` carry the gradient of the network.
        """
        index = self._step_index(rollout, steps)
        rows = torch.arange(len(rollout), device=rollout.latents.device)
        cond = {k: v[rollout.prompt_ids.to(v.device)] for k, v in rollout.cond.items()}
        columns = []
        for j in range(index.shape[1]):
            step = index[:, j]
            dev = step.to(rollout.latents.device)
            states, next_states = rollout.latents[rows, dev], rollout.latents[rows, dev + 1]
            columns.append(self.score_transitions(rollout, states, next_states, step, cond, reference=reference))
        if len(columns) == 1:
            return StepOutput(*(t.unsqueeze(1) for t in columns[0]))
        return StepOutput(*(torch.stack(parts, dim=1) for parts in zip(*columns)))

    def score_transitions(
        self, rollout: DiffusionRollout, states: torch.Tensor, next_states: torch.Tensor, steps,
        cond: dict[str, torch.Tensor], *, reference: bool = False, return_prediction: bool = False,
    ):  # fmt: skip
        """Re-score single transitions `states -> next_states` that are not whole trajectories (replay buffers).

        The transitions must come from rollouts sampled like `rollout` (same sampler, noise level, guidance,
        number of steps and image size, hence the same schedule); `rollout` supplies those settings, the
        negative prompt's conditioning and the forward chunk size. Rows are scored in chunks of exactly
        `rollout.forward_batch_size`, as at rollout, so an unchanged policy reproduces the stored log-probs
        (see the module docstring on exactness; `score` is this function applied to a rollout's own rows).

        Args:
            rollout (`DiffusionRollout`): any rollout sampled with the transitions' settings.
            states, next_states (`torch.Tensor`): `[n, ...]` states `x_t` and the sampled `x_{t+1}`.
            steps: `[n]` step indices `t` (or an `int`); each must be a stochastic step of `rollout`.
            cond (`dict[str, torch.Tensor]`): per-row conditioning `[n, ...]` (`policy.encode(prompts)`).
            reference (`bool`, defaults to `False`): score under the reference policy (no gradient).
            return_prediction (`bool`, defaults to `False`): also return the network's (CFG-combined)
                prediction `[n, ...]` (noise for UNets, velocity for flow models).

        Returns:
            `StepOutput` with `log_prob [n]`, `mean [n, ...]`, `std [n]` and `next_states` as `prev_sample`;
            with `return_prediction`, `(StepOutput, prediction)`.
        """
        n = len(states)
        step = torch.as_tensor(steps, dtype=torch.long).cpu()
        step = step.expand(n) if step.ndim == 0 else step
        if step.shape != (n,) or len(next_states) != n:
            raise ValueError(f"steps and next_states must have one entry per state ({n}); got {tuple(step.shape)}")
        if ((step < 0) | (step >= rollout.num_steps)).any():
            raise ValueError(f"step indices must lie in [0, {rollout.num_steps}), got {step.unique().tolist()}")
        if not bool(rollout.sde_mask[step].all()):
            bad = sorted(set(step[~rollout.sde_mask[step]].tolist()))
            raise ValueError(f"steps {bad} were sampled deterministically (outside the SDE window); nothing to score")
        cfg = rollout.null_cond is not None
        plan = self._plan(n, rollout.forward_batch_size, cond, rollout.null_cond)
        predictions = [] if return_prediction else None
        with self._scoring_model(reference) as model:
            out = self._run(
                model, rollout.sampler, states, step, plan, cfg=cfg, static=rollout.static, sigmas=rollout.sigmas,
                timesteps=rollout.timesteps, guidance_scale=rollout.guidance_scale, noise_level=rollout.noise_level,
                prev_sample=next_states, predictions=predictions,
            )  # fmt: skip
        if not return_prediction:
            return out
        return out, predictions[0] if len(predictions) == 1 else torch.cat(predictions)

    def velocity_fn(self, rollout: DiffusionRollout, num_draws: int, *, guidance_scale: float | None = None,
                    reference: bool = False):  # fmt: skip
        """A `velocity_fn(x_tau [B * N, C, h, w], tau [B * N])` over the rollout's prompts for FPO.

        Rows are sample-major (`flowrl.policies.fpo`). `tau` is the flow noise level; the network sees
        `tau * num_train_timesteps`. The conditional velocity is used (`guidance_scale` 1) unless
        `guidance_scale` is given; Flux keeps the rollout's guidance embedding. Forwards run in chunks of
        `rollout.forward_batch_size * num_draws` rows, so the losses stored at rollout reproduce exactly.
        Training calls go through `forward_module` (the accelerate/DDP-prepared network); `reference=True`
        gives the reference policy's velocity (no gradient).
        """
        if self.adapter.time_kind != "flow":
            raise ValueError(f"FPO needs a velocity model; a {self.family} model predicts noise")
        if guidance_scale is None:
            guidance_scale = 1.0 if self.adapter.uses_cfg(rollout.guidance_scale) else rollout.guidance_scale
        ids = rollout.prompt_ids.repeat_interleave(num_draws)
        cond = {k: v[ids.to(v.device)] for k, v in rollout.cond.items()}
        cfg = self.adapter.uses_cfg(guidance_scale)
        null_cond = self.encode([self.negative_prompt]) if cfg else None
        plan = self._plan(len(ids), rollout.forward_batch_size * num_draws, cond, null_cond)
        scale = float(self.adapter.scheduler.config.num_train_timesteps)

        def velocity(x, tau):
            parts = []
            with self._scoring_model(reference) as model:
                for chunk in plan:
                    rows = slice(None) if chunk.rows is None else chunk.rows.to(x.device)
                    t = (tau[rows] * scale).to(x.device)
                    out = self._predict(model, x[rows], t, chunk.cond, cfg, guidance_scale, rollout.static)
                    parts.append(out[: chunk.real])
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return velocity

    def log_prob(self, rollout: DiffusionRollout, steps, *, reference: bool = False) -> torch.Tensor:
        """`[B, k]` log-probabilities of the stored transitions at `steps` (see `score`)."""
        return self.score(rollout, steps, reference=reference).log_prob

    @contextmanager
    def _scoring_model(self, reference: bool):
        if not reference:
            yield self.forward_module if self.forward_module is not None else self.model
            return
        with torch.no_grad(), self.reference() as model:
            yield model

    @staticmethod
    def _step_index(rollout: DiffusionRollout, steps) -> torch.Tensor:
        b, t = len(rollout), rollout.num_steps
        index = torch.as_tensor(steps, dtype=torch.long).cpu()
        if index.ndim == 0:
            index = index.expand(b, 1)
        elif index.ndim == 1:
            index = index.unsqueeze(1)
        if index.ndim != 2 or index.shape[0] != b:
            raise ValueError(f"steps must be an int, [B] or [B, k] with B={b}; got shape {tuple(index.shape)}")
        if ((index < 0) | (index >= t)).any():
            raise ValueError(f"step indices must lie in [0, {t}), got {index.unique().tolist()}")
        return index.contiguous()


def from_callable(model, encode, decode, latent_shape, scheduler, **kwargs) -> DiffusionPolicy:
    """A policy over any SD3-convention velocity network with callable text encoder and decoder."""
    return DiffusionPolicy(CallableAdapter(model, encode, decode, latent_shape, scheduler), **kwargs)


def _steps(num_steps: int, label: str | None):
    """`range(num_steps)`, with a transient progress bar when `label` is given."""
    if label is None:
        return range(num_steps)
    from tqdm.auto import tqdm

    return tqdm(range(num_steps), desc=label, unit="step", leave=False)
