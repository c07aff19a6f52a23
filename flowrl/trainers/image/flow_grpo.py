"""Flow-GRPO (Liu et al. 2025, arXiv:2505.05470): GRPO on the per-step Gaussian policy of a flow-SDE sampler.

Per epoch: m prompts x k samples with the flow-SDE sampler (`sampling`), group-relative advantages of the
terminal reward (group mean, group or global std, clipped to +-5), then PPO-clip on each trained step's
log-ratio `log pi_theta(x_{t+1} | x_t) - log pi_old(...)` with the same advantage at every step, plus an
optional KL to the reference policy. Defaults follow Flow-GRPO's SD3.5 recipe (`config/grpo.py`): clip 1e-4,
global std (population), advantage clip 5, the first 99% of the steps (9 of 10), uniform step weights, the KL
in the code's form (the exact step KL times |dt|) when `kl.beta` > 0.

Any objective of the core trains here (`objective.name: gspo` uses the trajectory's geometric-mean ratio over
the trained steps, `sapo`, `cispo`, ...), with any advantage estimator (`advantage.estimator: per_prompt` is
DDPO's running per-prompt statistics) and any step selection and weighting.
"""

from __future__ import annotations

from flowrl.run.registry import register
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


DESCRIPTION = "Flow-GRPO: PPO-clip on flow-SDE step log-probs with group advantages (arXiv:2505.05470)"

register("flow_grpo", description=DESCRIPTION)(FlowGRPO)

__all__ = ["FlowGRPO", "FlowGRPOConfig"]
