"""deepinfer's inference engine: `LLM` (offline), `AsyncLLM` (online), `SamplingParams`.

Light on purpose: importing `engine` or `engine.scheduler` imports no torch; the heavy classes
load on first attribute access.
"""

from deepinfer.engine.config import apply_blas_determinism

# MKL_DYNAMIC off (engine/config.py says why) before any engine module loads torch
apply_blas_determinism()

from deepinfer.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from deepinfer.engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from deepinfer.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "EngineConfig":
        from deepinfer.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
