"""Image (and video) algorithms: one module per trainer, each registered under its module's name."""
