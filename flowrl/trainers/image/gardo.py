"""GARDO (He et al. 2025, arXiv:2512.24138): Flow-GRPO whose KL applies only to uncertain samples, whose reference
is reset to the policy from time to time, and whose positive advantages grow with a sample's novelty in its group.

Per epoch, on Flow-GRPO's loop (`FlowGRPO`):

1. **Advantages**: the group-centred proxy reward, not divided by a std (the code's `gardo` tracker mode); where
   it is >= 0 it is multiplied by `d_i / mean_group(d)`, `d_i` the cosine distance from the sample's features to
   its nearest group peer (`flowrl.core.diversity_factor`); then clipped to +-5.
2. **Gate**: each sample's rank under the proxy (the weighted training reward) and under the auxiliary rewards
   (`uncertainty_rewards`, usually weight 0 in `rewards`) give `u = rank_proxy - mean rank_aux`; the samples above
   the `(1 - f)` quantile of the non-negative `u` are gated, `f` adapted by `flowrl.core.RiskController`.
3. **KL**: Flow-GRPO's step KL to the reference (`kl`, beta 0.04 in Flow-GRPO's code form) on the gated samples
   only, each scaled by `n / n_gated` so that the penalty is beta times the gated samples' mean KL
   (`gated_kl_mean`; the code averages over each micro-batch's gated samples, the same in expectation).
4. **Reference reset**: at the start of an epoch the reference becomes the current policy when the gated KL of
   any optimizer step of the previous epoch exceeded `reset_kl`, or more than `reset_freq` epochs have passed
   since the last reset.

Defaults follow the released code (tinnerhrhe/GARDO @ 1cc77fb, `config/gardo.py::general_ocr_sd3` and
`scripts/train_sd3_grpo_gardo.py`): beta 0.04, `kl_thres` 3e-4, `reset_freq` 15, a base fraction 0.1 in
[0.02, 0.2] moved by 10% against a 20-epoch window, auxiliary rewards aesthetic and imagereward, 8 of 10 steps
(`timestep_fraction` 0.89), clip 1e-4, advantage clip 5. The reference is a frozen copy of the network (the code
keeps a second LoRA adapter): LoRA runs hold a copy of the whole network.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.core import RiskController, diversity_factor, nearest_peer_distance, rank_uncertainty, uncertainty_gate
from flowrl.image import StepConfig
from flowrl.registry import import_path
from flowrl.run.advantages import AdvantageEstimator
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, KLConfig
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


@dataclasses.dataclass
class GARDOConfig(FlowGRPOConfig):
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.04, form="gaussian_dt"))
    """The gated KL: beta 0.04 (the OCR and default recipes; 0.07 GenEval, 0.01 Flux) in Flow-GRPO's code form."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=lambda: AdvantageConfig(std="none", clip=5.0))
    """Group mean only (`type='gardo'` drops the std), clipped to +-5 after the diversity factor."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(fraction=0.89))
    """The first int(10 * 0.89) = 8 of 10 steps (`timestep_fraction` 0.89)."""
    uncertainty_rewards: list[str] = dataclasses.field(default_factory=lambda: ["aesthetic", "imagereward"])
    """Auxiliary rewards whose batch ranks are compared with the proxy's (names in `rewards`, usually weight 0; a
    leading `-` ranks lower scores higher); empty: the KL applies to every sample."""
    uncertain_when: Literal["aux_higher", "proxy_higher"] = "aux_higher"
    """Which disagreement gates: `aux_higher` (the code: `rank_proxy - mean rank_aux`, the auxiliaries rank the
    sample above the proxy) or `proxy_higher` (the proxy ranks it above the auxiliaries)."""
    kl_fraction: float = 0.1
    """The gated fraction of the samples with non-negative uncertainty at the first epoch (`RiskCompensator.base`)."""
    kl_fraction_range: tuple[float, float] = (0.02, 0.2)
    """Bounds of the adapted fraction (`beta_min`, `beta_max`)."""
    kl_fraction_rate: float = 0.1
    """Relative change of the fraction when the epoch's mean uncertainty leaves the window's range (`alpha`)."""
    kl_fraction_window: int = 20
    """Epochs of mean uncertainty the fraction is compared against (the code's 20-entry `risk_buffer`)."""
    gated_kl_mean: bool = True
    """Scale each gated sample's KL by `n / n_gated`, so the penalty is beta times the gated samples' mean KL (the
    code's `mean(kl[idx])`); False: beta times the gated KL averaged over every sample."""
    reset_freq: int = 15
    """Reset the reference when more than this many epochs have passed since the last reset (`reset_freq`)."""
    reset_kl: float | None = 3e-4
    """Also reset at the next epoch when an optimizer step's mean KL over the gated samples exceeds this
    (`kl_thres`, "set according to specific tasks"); None: only `reset_freq`."""
    diversity_features: str | None = "pixels"
    """The features of the diversity factor: `pixels` (the images, at most 64x64, flattened), a
    `package.module:function` mapping images `[B, C, H, W]` to `[B, D]` (the code: DINOv3 ViT-L/16 embeddings), or
    None (no diversity factor)."""

    def checks(self):
        names = {r.name for r in self.rewards}
        missing = [n for n in self.uncertainty_rewards if n.removeprefix("-") not in names]
        low, high = self.kl_fraction_range
        features = self.diversity_features
        return [
            *super().checks(),
            (
                not missing,
                f"gardo compares the proxy's ranks with uncertainty_rewards {missing}: add them to rewards (weight 0 "
                "keeps them out of the trained reward), or set uncertainty_rewards: [] to apply the KL to every "
                "sample",
            ),
            (
                0 <= low <= self.kl_fraction <= high <= 1,
                f"need 0 <= kl_fraction_range[0] <= kl_fraction <= kl_fraction_range[1] <= 1, got {self.kl_fraction} "
                f"in {self.kl_fraction_range}",
            ),
            (
                self.kl_fraction_rate >= 0 and self.kl_fraction_window >= 1,
                "kl_fraction_rate must be >= 0 and kl_fraction_window >= 1",
            ),
            (self.reset_freq >= 1, f"reset_freq must be >= 1, got {self.reset_freq}"),
            (self.reset_kl is None or self.reset_kl > 0, f"reset_kl must be > 0 (or null), got {self.reset_kl}"),
            (
                features in (None, "pixels") or ":" in features,
                f"diversity_features must be 'pixels', a package.module:function or null, got {features!r}",
            ),
        ]


def pixel_features(images: torch.Tensor) -> torch.Tensor:
    """`[B, D]` the images as vectors, at most 64x64 (area-downsampled; videos frame by frame)."""
    x = images.float()
    if x.shape[-1] > 64:
        size = (64, 64) if x.ndim == 4 else (x.shape[2], 64, 64)
        x = torch.nn.functional.interpolate(x, size=size, mode="area")
    return x.flatten(1)


@register(
    "gardo",
    description="GARDO: Flow-GRPO with a KL on uncertain samples only, reference resets and diversity-scaled "
    "advantages (arXiv:2512.24138)",
)
class GARDO(FlowGRPO):
    """GARDO; see the module docstring and `GARDOConfig`."""

    config_class = GARDOConfig
    shard_refusal = "GARDO resets its reference by copying the whole trained network"

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        c = config
        # the diversity factor multiplies the unclipped advantages; the clip follows it (the code clips in the loss)
        weights = {spec.name: spec.weight for spec in c.rewards}
        self.estimator = AdvantageEstimator(dataclasses.replace(c.advantage, clip=None), weights, c.reward_aggregation)
        self.risk = RiskController(c.kl_fraction, c.kl_fraction_rate, *c.kl_fraction_range, c.kl_fraction_window)
        features = c.diversity_features
        self.features_fn = (
            None
            if features is None
            else (pixel_features if features == "pixels" else import_path(features, "diversity_features"))
        )
        self.gate: torch.Tensor | None = None
        """`[N]` bool: the epoch's samples whose KL applies."""
        self.gate_scale = 1.0
        self._gate_stats: dict = {}
        self.last_reset, self.resets, self.reset_pending = 0, 0, False
        self._kl = torch.zeros(2, dtype=torch.float64)  # the step's gated KL sum and element count
        self._step_kls: list[float] = []

    def build(self):
        super().build()
        if self.needs_reference() and self.policy.reference_model is None:
            # a LoRA run's reference is the network with its adapter disabled: a reset needs weights of its own
            self.policy.freeze_reference(offload=self.config.kl.reference_offload)

    # ------------------------------------------------------------------------------------------
    # advantages and the gate
    # ------------------------------------------------------------------------------------------

    def features(self, collected) -> torch.Tensor:
        """`[N, D]` every process's sample features, in the epoch's order."""
        local = self.features_fn(collected.data.images)
        return self.processes.gather_at(local.detach().float().cpu(), collected.rows, collected.size)

    def advantages(self, collected, valid):
        adv, stats = super().advantages(collected, valid)  # group-centred, not clipped yet
        if self.features_fn is not None:
            groups = collected.group_ids[valid]
            distance = nearest_peer_distance(self.features(collected)[valid], groups)
            factor = diversity_factor(distance, groups, adv[valid])
            adv[valid] = adv[valid] * factor
            stats["diversity_factor_mean"] = float(factor[adv[valid] > 0].mean()) if (adv[valid] > 0).any() else 1.0
            stats["peer_distance_mean"] = float(distance.mean()) if len(distance) else 0.0
        clip = self.config.advantage.clip
        if clip is not None:
            adv = adv.clamp(-clip, clip)
        kept = adv[valid]
        if len(kept):  # the statistics of the advantages as trained
            stats.update(
                adv_mean=float(kept.mean()),
                adv_std=float(kept.std(unbiased=False)),
                adv_abs_max=float(kept.abs().max()),
            )
        self.gate, self._gate_stats = self.uncertainty_gate(collected, valid)
        return adv, stats

    def uncertainty_gate(self, collected, valid) -> tuple[torch.Tensor, dict]:
        """`([N] bool, stats)`: the samples whose KL applies this epoch."""
        names = self.config.uncertainty_rewards
        if not names:
            return valid.clone(), {}
        proxy = collected.total[valid].float()
        aux = []
        for name in names:
            sign = -1.0 if name.startswith("-") else 1.0
            scores = sign * collected.rewards[name.removeprefix("-")][valid].float()
            aux.append(torch.nan_to_num(scores, nan=-float("inf")))  # a missing score ranks last
        u = rank_uncertainty(proxy, aux, direction=self.config.uncertain_when)
        gate = torch.zeros(len(valid), dtype=torch.bool)
        candidates = u[u >= 0]
        if candidates.numel():
            fraction = self.risk.update(float(candidates.mean()))
            gate[valid] = uncertainty_gate(u, fraction)
        return gate, {
            "gardo/uncertainty_mean": float(candidates.mean()) if candidates.numel() else 0.0,
            "gardo/kl_fraction": self.risk.fraction,
        }

    def prepare(self, collected, advantages, trainable, epoch):
        batch, stats = super().prepare(collected, advantages, trainable, epoch)
        reset = False
        if self.needs_reference():
            overdue = epoch - self.last_reset > self.config.reset_freq
            if (epoch != 0 and self.reset_pending) or overdue:
                self.policy.reset_reference()
                self.last_reset, self.resets, self.reset_pending, reset = epoch, self.resets + 1, False, True
        gated = self.gate & trainable
        n, n_gated = int(trainable.sum()), int(gated.sum())
        self.gate_scale = n / n_gated if self.config.gated_kl_mean and n_gated else 1.0
        self._kl.zero_()
        self._step_kls = []
        return batch, {
            **stats,
            **self._gate_stats,
            "gardo/gated_frac": n_gated / max(n, 1),
            "gardo/reset": float(reset),
            "gardo/resets": float(self.resets),
        }

    # ------------------------------------------------------------------------------------------
    # the gated KL and the reset check
    # ------------------------------------------------------------------------------------------

    def terms(self, batch, index):
        terms = super().terms(batch, index)
        kl = terms.logs.get("kl")
        if kl is None:
            return terms
        gate = torch.ones(len(batch), dtype=torch.bool) if self.gate is None else self.gate[batch.rows.cpu()]
        gate = gate.to(kl.device, kl.dtype)[:, None]  # [b, 1]
        if batch.row_valid is not None:
            gate = gate * batch.row_valid.to(kl.device, kl.dtype)[:, None]
        if terms.penalty is not None:
            terms.penalty = terms.penalty * (gate * self.gate_scale)
        self._kl += torch.stack([(kl * gate).sum(), (gate * torch.ones_like(kl)).sum()]).double().cpu()
        return terms

    def after_step(self):
        super().after_step()
        if not self.needs_reference():
            return
        total, count = self.processes.gather(self._kl.clone()).view(-1, 2).sum(0).tolist()
        self._kl.zero_()
        if count:
            step_kl = total / count
            self._step_kls.append(step_kl)
            if self.config.reset_kl is not None and step_kl > self.config.reset_kl:
                self.reset_pending = True

    def finish(self, batch, epoch):
        out = super().finish(batch, epoch)
        if self._step_kls:
            out["gardo/kl_gated"] = sum(self._step_kls) / len(self._step_kls)
            out["gardo/kl_gated_max"] = max(self._step_kls)
        out["gardo/reset_pending"] = float(self.reset_pending)
        return out

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def state_dict(self):
        state, tensors = super().state_dict()
        state["gardo"] = {
            "risk": self.risk.state_dict(),
            "last_reset": self.last_reset,
            "resets": self.resets,
            "reset_pending": self.reset_pending,
        }
        if self.resets:  # the reference differs from the base model in the trained parameters only
            reference = dict(self.policy.reference_model.named_parameters())
            names = [name for name, p in self.policy.model.named_parameters() if p.requires_grad]
            tensors.update({f"gardo_reference.{name}": reference[name].detach().cpu() for name in names})
        return state, tensors

    def load_state_dict(self, state, tensors):
        super().load_state_dict(state, tensors)
        own = state.get("gardo")
        if own is None:
            return
        self.risk.load_state_dict(own["risk"])
        self.last_reset, self.resets, self.reset_pending = own["last_reset"], own["resets"], own["reset_pending"]
        saved = {k.removeprefix("gardo_reference."): v for k, v in tensors.items() if k.startswith("gardo_reference.")}
        if saved:
            reference = dict(self.policy.reference_model.named_parameters())
            with torch.no_grad():
                for name, value in saved.items():
                    reference[name].copy_(value)
