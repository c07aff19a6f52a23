"""Continuous-control algorithms (Gymnasium): one module per trainer, each registered under its module's name."""
