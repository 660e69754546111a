"""Fine-tuning quality benchmark: LoRA vs BD-LoRA at matched trainable parameters (see bench/README.md)."""
