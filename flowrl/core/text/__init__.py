"""The objectives of the text-RL literature, one module per family, on the shared `[B, K]` core.

- `clipping`: PPO's clip on the token ratio with bounds of their own (BNPO, BAPO, DCPO, CE-GPPO, PSPO, ASPO);
- `sequence`: ratios of a whole response or of a segment (GMPO, DHPO, Turn-PPO, MinPRO, VESPO, LUSPO);
- `reinforce`: REINFORCE with a masked, truncated or regularised importance weight (DISPO, DRO, GPG, DPPO);
- `entropy`: objectives that read token entropies or the log-prob/advantage covariance (SSPO, ESPO, the 80/20
  rule, Clip-Cov, KL-Cov, R2VPO);
- `group`: losses that compare the responses to one prompt (TRPA, Reg-GRPO, GTPO, ST-PPO);
- `humanline`: Humanline GRPO's clamped ratio; `troll`: TROLL's KL trust-region projection.

Each module registers its objectives with `flowrl.core.objectives.register_objective` when it is imported, and this
package imports every module of itself, so a new family is one module here (plus its test). Nothing in them is
text-specific: they run on denoising steps and control actions too.
"""

import importlib
import pkgutil


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
