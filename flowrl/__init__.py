"""flowrl: reinforcement-learning fine-tuning of diffusion and flow-matching models on one objective core."""

from flowrl._moved import install as _install_moved_paths


__version__ = "0.1.0"

_install_moved_paths()  # old module paths keep importing, with a DeprecationWarning (flowrl._moved.MOVED)
