"""GARDO's tensor pieces (He et al. 2025, arXiv:2512.24138): the uncertainty gate of its KL and its diversity factor.

GARDO ("Gated and Adaptive Regularization with Diversity-aware Optimization") regularises only the samples whose
proxy reward looks unreliable, resets the reference to the policy from time to time (a trainer hook:
`flowrl.trainers.image.gardo`), and scales the positive advantages by how far each sample lies from its group. The
formulas follow the released code (tinnerhrhe/GARDO @ 1cc77fb, `scripts/train_sd3_grpo_gardo.py` and
`flow_grpo/stat_tracking.py`); docs/algorithms/gardo.md lists where the paper could not be checked.

- **Uncertainty** (`train_sd3_grpo_gardo.py` l.826-837): every sample's rank in the epoch's batch under the proxy
  reward and under each auxiliary reward model (rank 1 = highest score); `u = rank_proxy - mean_k rank_aux_k`.
- **Gate**: among the samples with `u >= 0`, those above the `(1 - f)` quantile (linear interpolation, numpy's
  `percentile`), where the fraction `f` is adapted each epoch by `RiskController` (the code's `RiskCompensator`).
- **Diversity factor** (`stat_tracking.py` l.114-135): `d_i = min_{j != i in the group} (1 - cos(e_i, e_j))` of the
  samples' feature embeddings (DINOv3 in the code), and `A_i <- A_i d_i / mean_group(d)` where `A_i >= 0`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowrl.core.advantages import group_index


def batch_ranks(scores: torch.Tensor) -> torch.Tensor:
    """`[N]` rank of each score in the batch, 1 for the highest (ties: the earlier sample ranks first)."""
    order = torch.sort(scores.detach().float(), descending=True, stable=True).indices
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    return ranks


def rank_uncertainty(
    proxy: torch.Tensor, auxiliaries: Sequence[torch.Tensor], *, direction: str = "aux_higher"
) -> torch.Tensor:
    """`[N]` GARDO's reward uncertainty: how much better the auxiliary rewards rank a sample than the proxy does.

    `u = rank_proxy - mean_k rank_aux_k` with rank 1 the batch's highest score (`direction="aux_higher"`, the
    released code: `reward_std[-1] - (reward_std[0] + reward_std[1]) / 2` over the ranks of aesthetic,
    imagereward and the main reward); `"proxy_higher"` flips the sign (a sample the proxy ranks above the
    auxiliaries: the usual picture of reward hacking).

    Args:
        proxy (`torch.Tensor`): `[N]` the trained reward.
        auxiliaries (`Sequence[torch.Tensor]`): `[N]` scores of each auxiliary reward (higher is better).
        direction (`str`): `"aux_higher"` or `"proxy_higher"`.
    """
    if direction not in ("aux_higher", "proxy_higher"):
        raise ValueError(f"direction must be 'aux_higher' or 'proxy_higher', got {direction!r}")
    if not auxiliaries:
        raise ValueError("rank_uncertainty needs at least one auxiliary reward")
    aux = torch.stack([batch_ranks(a) for a in auxiliaries]).mean(0)  # [N]
    u = batch_ranks(proxy) - aux
    return u if direction == "aux_higher" else -u


def uncertainty_gate(uncertainty: torch.Tensor, fraction: float) -> torch.Tensor:
    """`[N]` bool: the samples whose uncertainty exceeds the `(1 - fraction)` quantile of the non-negative ones.

    The code: `threshold = np.percentile(u[u >= 0], 100 - 100 f)`, `gate = u > threshold` (so about a fraction `f`
    of the samples with `u >= 0`); no sample with `u >= 0` gates nothing.
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    u = uncertainty.detach().double()
    candidates = u[u >= 0]
    if candidates.numel() == 0:
        return torch.zeros(u.shape, dtype=torch.bool)
    threshold = torch.quantile(candidates, 1.0 - fraction)  # linear interpolation, as numpy's percentile
    return (u > threshold).cpu()


class RiskController:
    """GARDO's adaptive gate fraction (the code's `RiskCompensator`, `train_sd3_grpo_gardo.py` l.219-236).

    Each epoch it sees `m`, the mean of the non-negative uncertainties: the first time the fraction is `base`;
    later it grows by `1 + rate` when `m` exceeds every value in the window of the last `window` epochs, shrinks by
    `1 - rate` when `m` is below all of them, and is clipped to `[low, high]`. State: the fraction and the window.
    """

    def __init__(self, base: float = 0.1, rate: float = 0.1, low: float = 0.02, high: float = 0.2, window: int = 20):
        if not 0 <= low <= high <= 1 or rate < 0 or window < 1:
            raise ValueError(
                f"need 0 <= low <= high <= 1, rate >= 0 and window >= 1; got {low}, {high}, {rate}, {window}"
            )
        self.base, self.rate, self.low, self.high, self.window = base, rate, low, high, window
        self.fraction = base
        self.history: list[float] = []

    def update(self, mean_uncertainty: float) -> float:
        """The fraction for this epoch, after seeing its mean non-negative uncertainty."""
        m = float(mean_uncertainty)
        if not self.history:
            self.fraction = self.base
        elif m > max(self.history):
            self.fraction *= 1 + self.rate
        elif m < min(self.history):
            self.fraction *= 1 - self.rate
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = [*self.history, m][-self.window :]
        return self.fraction

    def state_dict(self) -> dict:
        return {"fraction": self.fraction, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.fraction, self.history = float(state["fraction"]), [float(v) for v in state["history"]]


def nearest_peer_distance(features: torch.Tensor, group_ids) -> torch.Tensor:
    """`[N]` cosine distance `1 - cos(e_i, e_j)` from each sample to its nearest other member of its group.

    Features are L2-normalised (a zero vector stays zero) and NaN/inf set to 0 first, as the code's
    `np.nan_to_num`; the cosine is clipped to [-1, 1]. A sample alone in its group gets distance 0.
    """
    inverse, _ = group_index(group_ids)
    e = torch.nan_to_num(features.detach().flatten(1).double(), nan=0.0, posinf=0.0, neginf=0.0)
    e = torch.nn.functional.normalize(e, dim=1)
    distance = 1 - (e @ e.T).clamp(-1.0, 1.0)  # [N, N]
    inverse = inverse.to(distance.device)
    peers = (inverse[:, None] == inverse[None, :]) & ~torch.eye(len(e), dtype=torch.bool, device=distance.device)
    nearest = distance.masked_fill(~peers, float("inf")).amin(1)  # [N]
    return torch.where(torch.isfinite(nearest), nearest, 0.0).float().cpu()


def diversity_factor(distance: torch.Tensor, group_ids, advantages: torch.Tensor) -> torch.Tensor:
    """`[N]` GARDO's multiplier of the advantages: `d_i / mean_group(d)` where `A_i >= 0`, 1 where `A_i < 0`.

    `mean_group(d)` is over every member of the group (the code: `prompt_dists / np.mean(prompt_dists)` before
    the sign test); a group whose distances are all 0 keeps factor 1.
    """
    inverse, num_groups = group_index(group_ids)
    d = distance.detach().double().cpu()
    inverse = inverse.cpu()
    count = torch.zeros(num_groups, dtype=d.dtype).index_add_(0, inverse, torch.ones_like(d))
    mean = torch.zeros(num_groups, dtype=d.dtype).index_add_(0, inverse, d) / count  # [G]
    ratio = torch.where(mean[inverse] > 0, d / mean[inverse].clamp_min(1e-300), 1.0)
    return torch.where(advantages.detach().cpu() < 0, 1.0, ratio).float()
