"""Text algorithms (Hugging Face causal LMs): one module per trainer, each registered under its module's name."""
