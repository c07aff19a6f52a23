"""`FlowrlGRPOConfig`: trl's `GRPOConfig` with a flowrl objective in place of trl's loss fields, and
`trl_loss_as_objective`, the flowrl objective equal to each trl loss type (`flowrl.llm.trl` has the trainer)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any


try:
    from trl import GRPOConfig
except ImportError as err:  # the `trl` extra
    raise ImportError("flowrl.llm.trl needs trl: pip install 'flowrl-toolkit[trl]'") from err

from flowrl.core.aggregation import AGGREGATIONS
from flowrl.core.objectives import COMMON_HPARAMS, DIAGNOSTICS, get_objective, list_objectives
from flowrl.registry import unknown_name_error


TOKEN_MEAN_NORMALIZERS = ("global", "local")

# trl's loss fields that FlowrlGRPOTrainer ignores, with their GRPOConfig defaults
_TRL_LOSS_FIELDS = {
    "loss_type": "dapo",
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "importance_sampling_level": "token",
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
}


@dataclass
class FlowrlGRPOConfig(GRPOConfig):
    """`GRPOConfig` whose policy loss is a flowrl objective (see `FlowrlGRPOTrainer`).

    trl's loss fields (`loss_type`, `epsilon`, `epsilon_high`, `delta`, `importance_sampling_level`,
    `sapo_temperature_*`, `vespo_*`) are ignored; `trl_loss_as_objective(GRPOConfig(...))` translates them.
    Every other field (`beta`, `use_bias_correction_kl`, `top_entropy_quantile`, `entropy_coef`,
    `off_policy_mask_threshold`, vLLM importance sampling, generation, ...) keeps its trl meaning.

    Parameters:
        objective (`str`, *optional*, defaults to `"dapo"`):
            A registered flowrl objective (`flowrl.core.list_objectives()`), e.g. `"grpo"`, `"dapo"`, `"gspo"`,
            `"cispo"`, `"sapo"`. Its aggregation (`get_objective(name).agg`) picks trl's normaliser.
        objective_kwargs (`dict` or `str`, *optional*):
            The objective's hyper-parameters (`get_objective(name).hparams`, e.g. `clip_eps_low`,
            `clip_eps_high`) and the common ones `agg` (an aggregation of `flowrl.core.aggregation`) and
            `norm_len` (`seq_mean_token_sum_norm`'s constant, defaults to `max_completion_length` as in trl's
            `dr_grpo`), and `diagnostics`: `"clip"` (the default here: the clip fractions, the set trl logs),
            `"full"` (also the ratio's mean, std, min, max and the k3 KL, logged as `flowrl/<name>`) or `"none"`.
            A JSON string is parsed (command lines). Unknown keys raise `ValueError`.
        token_mean_normalizer (`str`, *optional*):
            For a `token_mean` aggregation: `"global"` divides by the token count of the whole accumulation
            window across processes (trl's `dapo`/`cispo`, DAPO arXiv:2503.14476 sec. 3.3), `"local"` by the
            micro-batch's own token count times the accumulation steps (trl's `bnpo`). Defaults to `"local"` for
            the objective `"bnpo"` and `"global"` for every other.
    """

    objective: str = field(
        default="dapo",
        metadata={"help": "Registered flowrl objective used as the policy loss (flowrl.core.list_objectives())."},
    )
    objective_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Hyper-parameters of the objective (and `agg`, `norm_len`), as a dict or a JSON string; "
            "trl's loss fields (loss_type, epsilon, ...) are ignored."
        },
    )
    token_mean_normalizer: str | None = field(
        default=None,
        metadata={
            "help": "Normaliser of a token_mean aggregation: 'global' (tokens of the accumulation window across "
            "processes, trl's dapo) or 'local' (tokens of the micro-batch, trl's bnpo); None: 'local' for the "
            "objective 'bnpo', 'global' otherwise.",
        },
    )

    def __post_init__(self):
        if isinstance(self.objective_kwargs, str):
            self.objective_kwargs = json.loads(self.objective_kwargs)
        self.objective_kwargs = dict(self.objective_kwargs or {})
        super().__post_init__()
        _check_objective(self.objective, self.objective_kwargs)
        if self.token_mean_normalizer is None:
            self.token_mean_normalizer = "local" if self.objective == "bnpo" else "global"
        if self.token_mean_normalizer not in TOKEN_MEAN_NORMALIZERS:
            raise unknown_name_error("token_mean_normalizer", self.token_mean_normalizer, list(TOKEN_MEAN_NORMALIZERS))
        changed = [k for k, default in _TRL_LOSS_FIELDS.items() if getattr(self, k) != default]
        if changed:
            warnings.warn(
                f"FlowrlGRPOConfig ignores trl's {', '.join(changed)}: the policy loss is objective="
                f"{self.objective!r} with objective_kwargs={self.objective_kwargs}; see trl_loss_as_objective()",
                stacklevel=3,
            )


def _check_objective(name: str, kwargs: dict[str, Any]) -> None:
    """Raise a one-line `ValueError` for an unknown objective, hyper-parameter or aggregation."""
    objective = get_objective(name)
    valid = [*objective.hparams, *objective.required, *(k for k in COMMON_HPARAMS if k != "weights")]
    for key in kwargs:
        if key == "weights":
            raise ValueError("objective_kwargs cannot set 'weights': FlowrlGRPOTrainer sets them per batch")
        if key not in valid:
            raise unknown_name_error("hyper-parameter", key, sorted(valid), where=f"for objective {name!r}")
    unbridged = _unbridged(name, objective)
    if unbridged:
        raise ValueError(unbridged)
    missing = [k for k in objective.required if k not in kwargs]
    if missing:
        raise ValueError(f"objective {name!r} needs objective_kwargs {', '.join(missing)}")
    agg = kwargs.get("agg", objective.agg)
    if agg not in AGGREGATIONS:
        raise unknown_name_error("aggregation", agg, list(AGGREGATIONS))
    diagnostics = kwargs.get("diagnostics", "clip")
    if diagnostics not in DIAGNOSTICS:
        raise unknown_name_error("diagnostics", diagnostics, list(DIAGNOSTICS))


def trl_loss_as_objective(args: GRPOConfig) -> dict[str, Any]:
    """The `FlowrlGRPOConfig` fields whose loss equals trl's for the loss settings of `args`.

    Returns `{"objective", "objective_kwargs", "token_mean_normalizer"}` (tested against trl 1.16's
    `GRPOTrainer._compute_loss`, values and gradients):

    | trl `loss_type` (`importance_sampling_level`) | flowrl objective | hyper-parameters |
    |---|---|---|
    | `grpo` (token) | `grpo` | `clip_eps_low = epsilon`, `clip_eps_high = epsilon_high or epsilon` |
    | `dapo` (token) | `dapo` | same; global token mean |
    | `dr_grpo` (token) | `dr_grpo` | same; `norm_len = max_completion_length` |
    | `bnpo` (token) | `bnpo` (or `ppo`) | same; `token_mean_normalizer="local"` |
    | any of the four (sequence) | `gspo` | same; the loss type's aggregation |
    | `cispo` (token) | `cispo` | `clip_eps_high = epsilon_high - 1` (trl's cap is absolute, flowrl's is `1 + eps`) |
    | `sapo` (token) | `sapo` | `tau_pos = sapo_temperature_pos`, `tau_neg = sapo_temperature_neg` |

    trl's two-sided clip `delta` is flowrl's dual clip `dual_clip_c = delta` (Ye et al. 2020,
    arXiv:1912.09729), exact when `delta >= 1 + epsilon_high` (trl recommends `delta > 1 + epsilon`).
    `luspo` and `vespo` map to flowrl objectives of the same name once they are registered.
    """
    loss_type, level = args.loss_type, args.importance_sampling_level
    eps_low = args.epsilon
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    sequence = level == "sequence"
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    clip_aggs = {
        "grpo": "seq_mean_token_mean",
        "dapo": "token_mean",
        "dr_grpo": "seq_mean_token_sum_norm",
        "bnpo": "token_mean",
    }
    if loss_type in clip_aggs:
        bnpo = "bnpo" if "bnpo" in list_objectives() else "ppo"  # PPO-clip with a token mean either way
        name = "gspo" if sequence else {"bnpo": bnpo}.get(loss_type, loss_type)
        kwargs: dict[str, Any] = {"clip_eps_low": eps_low, "clip_eps_high": eps_high}
        if clip_aggs[loss_type] != get_objective(name).agg:
            kwargs["agg"] = clip_aggs[loss_type]
        if loss_type == "dr_grpo":
            kwargs["norm_len"] = args.max_completion_length
        if args.delta is not None:
            if args.delta < 1 + eps_high:
                raise ValueError(f"trl's delta={args.delta} < 1 + epsilon_high has no flowrl equivalent (dual clip)")
            kwargs["dual_clip_c"] = args.delta
        normalizer = "local" if loss_type == "bnpo" else "global"
        return {"objective": name, "objective_kwargs": kwargs, "token_mean_normalizer": normalizer}
    if sequence and loss_type in ("cispo", "sapo"):
        raise ValueError(f"trl's {loss_type!r} with importance_sampling_level='sequence' has no flowrl equivalent")
    if loss_type == "cispo":
        return {
            "objective": "cispo",
            "objective_kwargs": {"clip_eps_high": eps_high - 1.0},
            "token_mean_normalizer": "global",
        }
    if loss_type == "sapo":
        kwargs = {"tau_pos": args.sapo_temperature_pos, "tau_neg": args.sapo_temperature_neg}
        return {"objective": "sapo", "objective_kwargs": kwargs, "token_mean_normalizer": "global"}
    if loss_type in ("luspo", "vespo"):
        if loss_type not in list_objectives():
            raise ValueError(f"flowrl has no {loss_type!r} objective yet")
        hparams = get_objective(loss_type).hparams
        candidates = {
            "clip_eps_low": eps_low,
            "clip_eps_high": eps_high,
            "k_pos": args.vespo_k_pos,
            "lambda_pos": args.vespo_lambda_pos,
            "k_neg": args.vespo_k_neg,
            "lambda_neg": args.vespo_lambda_neg,
        }
        kwargs = {k: v for k, v in candidates.items() if k in hparams}
        return {"objective": loss_type, "objective_kwargs": kwargs, "token_mean_normalizer": "global"}
    raise ValueError(f"unknown trl loss_type {loss_type!r}")


GROUP_INPUTS = ("group", "token_ids", "ref_logp")
"""Per-completion inputs of the group objectives (`flowrl.core.text.group`) that trl's loss never gets."""


def _unbridged(name: str, objective) -> str | None:
    """Why trl's `GRPOTrainer` cannot feed objective `name` its inputs (a one-line message), or None."""
    train = f"train it with flowrl's own trainer (flowrl train configs/llm/arith_{name}.yaml)"
    if {"topk_logp", "old_topk_logp"} & set(objective.inputs):
        return (
            f"objective {name!r} needs the top-k next-token log-probs of the old and new policies, and trl's "
            f"GRPOTrainer computes only the sampled tokens' log-probs: {train}"
        )
    group = [k for k in objective.required if k in GROUP_INPUTS]
    if group:
        return (
            f"objective {name!r} compares a prompt's completions ({', '.join(group)} per completion), and "
            "trl's GRPOTrainer shuffles each generation batch and splits it into steps_per_generation "
            f"micro-batches, so a loss call does not hold whole groups: {train}"
        )
    return None
