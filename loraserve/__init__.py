"""loraserve: one base model, many LoRA adapters, every batch mixed."""

from loraserve.types import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    # Lazy: `import loraserve` stays cheap (no torch) for the CLI's --help.
    if name == "LLM":
        from loraserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
