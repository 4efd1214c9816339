"""deepinfer's inference engine: `LLM` (offline), `AsyncLLM` (online), `SamplingParams`.

Light on purpose: importing `engine` or `engine.scheduler` imports no torch; the heavy classes
load on first attribute access.
"""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
