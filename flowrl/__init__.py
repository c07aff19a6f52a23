"""flowrl: reinforcement-learning fine-tuning of diffusion and flow-matching models on one objective core."""

__version__ = "0.1.0"
