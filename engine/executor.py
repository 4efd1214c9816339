"""The core/worker seam: `EngineCore` hands a `SchedulerOutput` to an `Executor` and gets a
`ModelRunnerOutput` back, or a future of it that the core resolves at its next step (that is
all asynchronous scheduling is: engine/async_step.py). The core never touches a tensor, the
model runner or the KV cache; everything on the far side of `Executor` does.

What crosses the seam is plain data: `SchedulerOutput` (ids, counts, block ids; its `kv_loads`
and `kv_saves` name the KV store's block copies), `ModelRunnerOutput` (lists), KV store
payloads as bytes (`stage_kv_blocks` in, `take_kv_reads` out), and numbers for KV cache
sizing (`num_blocks`, `block_bytes`).

One implementation today, `UniProcExecutor`: the worker side in this process (one rank, one
`ModelRunner`, one `KVBlockCopier`). A multi-process executor (expert parallelism, attention
data parallelism: one worker process per rank over torch.distributed, gloo on CPU, NCCL on
GPU) fits behind the same methods:
- `__init__` starts one process per rank; each builds its own `ModelRunner` (its experts, its
  KV cache shard) and joins the process group; collectives (all-to-all dispatch/combine) run
  between the workers inside their forward passes, never through the core.
- `num_blocks` is the minimum over ranks (each profiles its own memory), so the core's one
  block table is valid on every rank.
- `execute` broadcasts the `SchedulerOutput` to every rank (a pickled dataclass over a
  pipe/shared-memory queue) and returns a future that resolves to rank 0's
  `ModelRunnerOutput` (the ranks sample the same tokens). With `non_block=True` the core is
  not blocked until that future's `result()`.
- `stage_kv_blocks` / `take_kv_reads` carry bytes: each rank writes or reads its own slice of
  a block (the header's shape says which), rank 0 gathers for the store.
- `abort` drops the step in flight on every rank; `shutdown` joins the processes.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from deepinfer.engine.async_step import AsyncRunnerOutput
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_cache.spec import KVCacheSpec, num_blocks_for_budget
from deepinfer.engine.kv_transfer import KVBlockCopier, KVBlockRead
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.outputs import KVBlocks, ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.structured.manager import StructuredOutputManager
from deepinfer.kvstore.codec import BlockHeader

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # KV cache size on CPU when none is configured


class RunnerOutputFuture(Protocol):
    """A launched step's output: `result()` waits for it (once) and returns it."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    """The worker side of one engine, as the core sees it (see the module doc).

    num_blocks: KV cache blocks of `block_size` tokens (on every rank).
    block_bytes: bytes of one block, all layers (for logs and sizing).
    kv_cache_spec: the model's per-layer KV layout (numbers only: engine/kv_cache/spec.py).
    """

    num_blocks: int
    block_bytes: int
    kv_cache_spec: KVCacheSpec

    def warm_up(self, max_num_seqs: int, max_model_len: int) -> None:
        """Compile / capture what the worker needs before serving (CUDA graphs)."""

    def execute(self, scheduler_output: SchedulerOutput, *, non_block: bool
                ) -> ModelRunnerOutput | RunnerOutputFuture:
        """Run one step: fill `kv_loads` blocks, forward, sample, start copying `kv_saves`
        blocks out. `non_block`: return a future at once (the core resolves it at its next
        step; the next `execute` may be called before that); else the output itself."""

    def abort(self) -> None:
        """Forget the step in flight after a failed step (the core requeues its requests)."""

    def shutdown(self) -> None:
        """Release the worker's resources (processes, device memory)."""

    def kv_block_header(self) -> BlockHeader:
        """The layout, dtype and shape of one stored block (all layers)."""

    def stage_kv_blocks(self, request_id: str, block_hashes: list[int],
                        payloads: np.ndarray) -> None:
        """Blocks fetched from the KV store for a request, `[n, block_bytes]` uint8, held
        until a step's `kv_loads` names the blocks they go to (or the request finishes)."""

    def drop_staged_kv_blocks(self, request_ids) -> None:
        """Forget staged blocks of requests that finished before using them."""

    def take_kv_reads(self) -> list[tuple[list[KVBlocks], KVBlockRead]]:
        """The block copies out of the cache started since the last call (`kv_saves`)."""


class UniProcExecutor:
    """The worker side in this process: one `ModelRunner` and its KV cache.

    Args:
        config: the engine configuration (cache sizing, scheduler limits).
        model: the model, on `device` in `dtype`.
        device, dtype: where and in which dtype the KV cache lives.
        eos_token_ids: masked while a request is below its min_tokens.
        structured_output: the grammar backend (None: grammars are refused earlier).
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: frozenset[int],
                 structured_output: StructuredOutputManager | None = None):
        self.config = config
        cache = config.cache
        spec = model.kv_cache_spec(dtype.itemsize)  # FullAttentionSpec, MLAAttentionSpec
        self.num_blocks = cache.num_blocks or num_blocks_for_budget(
            spec, cache.block_size, self._kv_cache_budget_bytes(model, spec, device, dtype))
        self.block_bytes = spec.block_bytes(cache.block_size)
        self.kv_cache_spec = spec
        self.runner = ModelRunner(model, self.num_blocks, cache.block_size, device, dtype,
                                  eos_token_ids, structured_output=structured_output,
                                  kernel_config=config.kernel,
                                  mm_cache_bytes=config.multimodal.encoder_cache_bytes)
        self.kv = KVBlockCopier(self.runner)
        self._previous: AsyncRunnerOutput | None = None  # the non-blocking step in flight

    def _kv_cache_budget_bytes(self, model: torch.nn.Module, spec, device: torch.device,
                               dtype: torch.dtype) -> int:
        """The KV cache's bytes: as configured, else 1 GiB on CPU, else on CUDA what
        gpu_memory_utilization leaves after a profiling step (engine/gpu_memory.py)."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        from deepinfer.engine.gpu_memory import profile_kv_cache_budget

        scheduler = self.config.scheduler
        return profile_kv_cache_budget(
            model, spec, dtype=dtype, device=device, block_size=cache.block_size,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_num_seqs=scheduler.max_num_seqs,
            gpu_memory_utilization=cache.gpu_memory_utilization)

    def warm_up(self, max_num_seqs: int, max_model_len: int) -> None:
        if self.runner.device.type == "cuda" and not self.config.model.enforce_eager:
            spec = self.config.speculative
            self.runner.capture_cuda_graphs(
                max_num_seqs, max_model_len,
                verify_query_len=1 + spec.num_speculative_tokens if spec.enabled else 0,
                max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens)

    def execute(self, scheduler_output: SchedulerOutput, *, non_block: bool
                ) -> ModelRunnerOutput | AsyncRunnerOutput:
        self.kv.load(scheduler_output.kv_loads)
        if non_block:
            output = self.runner.execute_async(scheduler_output, self._previous)
            self._previous = output
        else:   # the core resolved every step in flight before a blocking one
            self._previous = None
            output = self.runner.execute(scheduler_output)
        self.kv.save(scheduler_output.kv_saves)
        return output

    def abort(self) -> None:
        self._previous = None

    def shutdown(self) -> None:
        self._previous = None

    def kv_block_header(self) -> BlockHeader:
        return self.kv.header

    def stage_kv_blocks(self, request_id: str, block_hashes: list[int],
                        payloads: np.ndarray) -> None:
        self.kv.stage_kv_blocks(request_id, block_hashes, payloads)

    def drop_staged_kv_blocks(self, request_ids) -> None:
        self.kv.drop_staged_kv_blocks(request_ids)

    def take_kv_reads(self) -> list[tuple[list[KVBlocks], KVBlockRead]]:
        return self.kv.take_kv_reads()
