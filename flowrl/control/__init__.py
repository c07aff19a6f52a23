"""Control: Gymnasium environments, policies (Gaussian, flow), the control rollout, its collector and evaluator.

The trainers that use them are `ppo`, `fpo` and `dppo` in `flowrl.trainers` (docs/control.md).
"""
