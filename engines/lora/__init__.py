"""LoRA adapters in mlx-lm's format, several per model, mixed in one batch.

docs/models-and-adapters.md says how they are served.
"""
