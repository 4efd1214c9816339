"""deepinfer's inference engine: `LLM` (offline), `AsyncLLM` (online), `SamplingParams`.

Light on purpose: importing `engine` or `engine.scheduler` imports no torch; the heavy classes
load on first attribute access.
"""

import os

# MKL (torch's CPU BLAS) may run a call on fewer threads when the machine is busy
# (MKL_DYNAMIC, on by default), and so in another float32 summation order: with two busy
# processes beside the test suite, a request's logprobs moved in their last bits between two
# otherwise equal runs (tests/engine/test_async_scheduling.py); with MKL_DYNAMIC=FALSE the same
# run was bitwise equal. Seeded outputs should not depend on the machine's load, so it is off
# unless the environment says otherwise. Set here, before any engine module loads torch.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

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
