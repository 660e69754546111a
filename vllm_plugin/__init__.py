"""vLLM plugin for BD-LoRA (placeholder until the plugin lands)."""


def register() -> None:
    return None
