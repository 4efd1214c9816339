"""`EngineCore`: one worker's step loop body — schedule, execute, update, detokenize.

Single owner of the scheduler and block state: only `step()`, `add_request()` and
`abort_requests()` touch them, and callers (LLM, AsyncLLM) run those on one thread. The model,
its runner and every tensor are behind the executor (engine/executor.py); the KV store's
bookkeeping is `kv_transfer` (engine/kv_transfer.py); a step that fails is undone and its
requests isolated (engine/fault_isolation.py).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.engine import loader
from deepinfer.engine.async_step import needs_sync_steps
from deepinfer.engine.batch_invariant import check_batch_invariant
from deepinfer.engine.config import EngineConfig, ModelConfig
from deepinfer.engine.dp_executor import build_executor
from deepinfer.engine.dp_scheduler import DPScheduler
from deepinfer.engine.errors import EngineDeadError, PromptTooLongError, outside_vocabulary
from deepinfer.engine.executor import Executor, RunnerOutputFuture
from deepinfer.engine.fault_isolation import FaultIsolation
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_transfer import KVTransfer, NoKVTransfer, model_fingerprint
from deepinfer.engine.mm_processor import adopt_chat_template, load_mm_processor
from deepinfer.engine.output_processor import OutputProcessor, TokenOutputProcessor
from deepinfer.engine.outputs import (EngineCoreOutput, ModelRunnerOutput, RequestOutput,
                                      SchedulerOutput, SchedulerStats)
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.structured.manager import grammar_manager

logger = logging.getLogger(__name__)



def resolve_device_dtype(config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but torch sees no CUDA device (a CPU-only "
                         "torch build, or no GPU visible); use --device cpu or auto.")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    return device, dtype


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(config: ModelConfig) -> str:
    """The name clients use: --served-model-name, else the model path's name (no .gguf)."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def _eos_token_ids(model_dir, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's."""
    ids = set()
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class EngineCore:
    """Args:
        config: the engine configuration.
        model: an already built model on the configured device and dtype (benchmarks build
            one in memory); None loads the weights from `config.model.model`, whose directory
            still provides config.json and the tokenizer.
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None, *,
                 detokenize: bool = True):
        self.config = config
        self.model_dir = loader.resolve_model_dir(config.model.model, config.model.cache_dir)
        self.model_name = served_model_name(config.model)
        device, dtype = resolve_device_dtype(config.model)
        hf_config = loader.load_hf_config(self.model_dir)
        self.tokenizer = loader.load_tokenizer(self.model_dir)
        # a vision-language model's processor (images -> pixel values, placeholder expansion)
        self.mm_processor = load_mm_processor(self.model_dir, hf_config, config.multimodal)
        adopt_chat_template(self.tokenizer, self.mm_processor)
        check_batch_invariant(config.kernel, device, dtype, hf_config)
        hf_config = hf_config.get_text_config()
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.tokenizer)
        data_parallel = config.parallel.data_parallel_size > 1
        if model is None and not data_parallel:   # with DP each rank loads its own
            model = loader.load_model(self.model_dir, dtype, device, config.kernel)
        self.structured_output = grammar_manager(
            self.tokenizer, self.vocab_size, self.eos_token_ids,
            config.model.structured_outputs_backend)
        self.executor: Executor = build_executor(config, model, self.model_dir, device, dtype,
                                                 self.eos_token_ids, self.structured_output)
        cache, num_blocks = config.cache, self.executor.num_blocks
        self.max_model_len = self._max_model_len(hf_config, num_blocks * cache.block_size)
        self.executor.warm_up(config.scheduler.max_num_seqs, self.max_model_len)
        fingerprint = model_fingerprint(self.model_dir, dtype, cache.block_size)
        self.kv_transfer = self._build_kv_transfer(fingerprint)
        self._attach_embedding_store(dtype)
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, hash_extra=fingerprint),
            save_kv_blocks=isinstance(self.kv_transfer, KVTransfer)
            and config.kv_transfer.role != "decode")
        if data_parallel:   # one scheduler and KV cache manager per rank (dp_scheduler.py)
            self.scheduler = DPScheduler([Scheduler(config.scheduler, KVCacheManager(
                blocks, cache.block_size, cache.enable_prefix_caching, hash_extra=fingerprint))
                for blocks in self.executor.num_blocks_per_rank])
        self.output_processor = (OutputProcessor(self.tokenizer) if detokenize
                                 else TokenOutputProcessor())
        async_scheduling = config.scheduler.async_scheduling
        if async_scheduling is None:  # default: on where the device runs apart from the host
            async_scheduling = device.type == "cuda"
        async_scheduling = async_scheduling and not data_parallel   # ranks step blocking
        self.spec = self._build_spec_decoder(model)
        if self.spec is not None and async_scheduling:
            method = config.speculative.speculative_method
            if self.spec.step_rate is None or method != "ngram":
                # fixed length drafts every step; mtp / draft_model drafters run in the model
                # runner after each blocking step's commit (their KV follows every token)
                logger.info("speculative decoding (%s, %s): async scheduling is off (accepting "
                            "drafts needs each step's sampled tokens on the host)", method,
                            "varlen" if self.spec.step_rate is not None else "fixed length")
                async_scheduling = False
            else:   # varlen n-gram: steps without drafts stay asynchronous (`_non_block`)
                self.spec.async_plain_steps = True
                self.spec.step_rate.overlapped_plain = True
        self.async_scheduling = async_scheduling
        self._in_flight: deque[_Step] = deque()   # launched, not yet resolved (oldest first)
        self._sync_ids: set[str] = set()   # unfinished requests that need blocking steps
        self._draft_free = self.spec is None   # the step being scheduled carries no drafts
        self._iteration_started = time.perf_counter()   # of the current step() call
        # a blocking step timed when its iteration ends: (its output, the iteration's start)
        self._untimed: tuple[SchedulerOutput, float] | None = None
        # the overlapped plain step a blocking step waits for (`_blocking_start`)
        self._drained: _Step | None = None
        self.faults = FaultIsolation()
        spec = self.executor.kv_cache_spec
        logger.info("KV cache: %s, %d bytes/token; %d blocks x %d tokens (%.1f MiB), "
                    "max_model_len=%d", type(spec).__name__, spec.bytes_per_token(), num_blocks,
                    cache.block_size, num_blocks * self.executor.block_bytes / 2**20,
                    self.max_model_len)

    def _build_kv_transfer(self, fingerprint: bytes) -> KVTransfer | NoKVTransfer:
        """The KV store bridge, or a stand-in when there is no store (or no prefix caching:
        block hashes are the store's keys)."""
        config = self.config.kv_transfer
        if self.config.parallel.data_parallel_size > 1:
            if config.role != "both":
                raise ValueError("prefill/decode roles need the KV store bridge, which data "
                                 "parallelism does not support; use data_parallel_size=1.")
            return NoKVTransfer()   # no KV store with DP (each rank its own cache)
        if not config.enabled:
            return NoKVTransfer()
        if not self.config.cache.enable_prefix_caching:
            if config.role != "both":
                raise ValueError(f"role={config.role} needs prefix caching (block hashes are the "
                                 "KV store's keys); do not disable it.")
            logger.warning("prefix caching is off, so the KV store %s is not used",
                           config.kv_store)
            return NoKVTransfer()
        logger.info("KV store: %s (role %s, model fingerprint %s)",
                    re.sub(r"//[^@/]*@", "//***@", config.kv_store), config.role,
                    fingerprint.hex())
        return KVTransfer(config, self.executor, fingerprint, self.config.cache.block_size)

    def _mm_embedder(self):
        """The runner's `MultiModalEmbedder` (in-process executors), or None."""
        return getattr(getattr(self.executor, "runner", None), "mm", None)

    def _attach_embedding_store(self, dtype: torch.dtype) -> None:
        """With a shared (Redis) store, images are looked up in its embedding namespace (an
        encoder worker may have put them there) before being encoded here."""
        store_url = self.config.kv_transfer.kv_store
        embedder = self._mm_embedder()
        if embedder is None or not store_url.startswith(("redis://", "rediss://")):
            return
        from deepinfer.engine.mm_encoder import EmbeddingStore, embedding_fingerprint

        embedder.store = EmbeddingStore(store_url, embedding_fingerprint(self.model_dir, dtype),
                                        self.config.kv_transfer.timeout_s)

    def _build_spec_decoder(self, model: torch.nn.Module):
        """The speculative decoder of `config.speculative` (None when off): its drafter and,
        for varlen admission, the verify path's step-rate table profiled now."""
        config = self.config.speculative
        if not config.enabled:
            return None
        if self.config.parallel.data_parallel_size > 1:
            raise ValueError(f"speculative_method={config.speculative_method!r} runs its drafter "
                             "beside the in-process model runner, which data parallelism does "
                             "not have; use data_parallel_size=1 or turn speculation off.")
        from deepinfer.engine.spec.manager import SpecDecoder
        from deepinfer.engine.spec.profile import profile_step_rate

        if config.speculative_method == "ngram":
            from deepinfer.engine.spec.ngram import NgramDrafter
            drafter = NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min,
                                   config.prompt_lookup_max)
        elif config.speculative_method == "mtp":
            from deepinfer.engine.spec.mtp import MTPDrafter
            drafter = MTPDrafter(model, self.executor.runner, config.num_speculative_tokens,
                                 self.config.scheduler.max_num_seqs)
        else:
            from deepinfer.engine.spec.draft_model import DraftModelDrafter
            runner = self.executor.runner
            try:
                draft_dir = loader.resolve_model_dir(config.speculative_model,
                                                     self.config.model.cache_dir)
            except (FileNotFoundError, ValueError) as error:   # say which model is wrong
                raise type(error)(f"speculative_model={config.speculative_model!r}: "
                                  f"{error}") from error
            drafter = DraftModelDrafter(
                loader.load_model(draft_dir, runner.kv_caches[0].dtype, runner.device),
                runner, config.num_speculative_tokens, self.config.scheduler.max_num_seqs)
        scheduler = self.config.scheduler
        step_rate = None
        if not config.spec_varlen:
            logger.info("speculative decoding (%s, fixed length): %d drafts verified a step",
                        config.speculative_method, config.num_speculative_tokens)
        else:
            logger.info("speculative decoding (%s, varlen): profiling the verify step's cost "
                        "(a few seconds on a GPU, up to minutes on a loaded CPU)",
                        config.speculative_method)
            step_rate = profile_step_rate(
                self.executor.runner, max_num_seqs=scheduler.max_num_seqs,
                num_speculative_tokens=config.num_speculative_tokens,
                max_num_batched_tokens=scheduler.max_num_batched_tokens)
            logger.info("speculative decoding (%s, varlen): step ms (plain by batch tokens, "
                        "verify extra by drafts) %s", config.speculative_method,
                        step_rate.as_milliseconds())
        return SpecDecoder(config, drafter, step_rate, scheduler.max_num_batched_tokens)

    def close(self) -> None:
        """Release the KV store connection and its thread, and the worker side."""
        if (embedder := self._mm_embedder()) is not None:
            embedder.close()
        self.kv_transfer.close()
        self.executor.shutdown()

    def _max_model_len(self, hf_config, kv_capacity_tokens: int) -> int:
        model_limit = getattr(hf_config, "max_position_embeddings", None) or kv_capacity_tokens
        wanted = self.config.model.max_model_len or model_limit
        if wanted > model_limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context window "
                             f"({model_limit} tokens); lower --max-model-len.")
        if wanted > kv_capacity_tokens:
            if self.config.model.max_model_len:
                raise ValueError(
                    f"max_model_len={wanted} needs more KV cache than the {kv_capacity_tokens} "
                    "tokens allocated; lower --max-model-len or give the KV cache more memory.")
            wanted = kv_capacity_tokens
        return wanted

    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, *,
                     kv_transfer_params: dict | None = None,
                     mm_inputs: list | None = None) -> Request:
        """Validate a tokenized prompt and build its `Request`.

        `mm_inputs`: the prompt's images (`engine.multimodal.ImageInput`, placed at their
        placeholder spans: `MultiModalProcessor.place`); a text-only model refuses them.

        `kv_transfer_params`: prefill/decode disaggregation (engine/kv_transfer.py), e.g.
        `{"do_remote_decode": True}` to store the prompt's blocks for a decode worker.

        Raises:
            PromptTooLongError: prompt (+ max_tokens) does not fit max_model_len.
            ValueError: empty prompt, or prompt / stop token ids outside the vocabulary.
            GrammarError (a ValueError): `so_args` cannot be compiled (compiles it unless
                cached; `AsyncLLM` compiles it in a worker thread first).
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token.")
        if mm_inputs and self.mm_processor is None:
            raise ValueError(f"{self.model_name} is a text-only model and accepts no images; "
                             "send text only, or serve a vision-language model.")
        if self.mm_processor is not None:
            self._check_image_tokens(prompt_token_ids, mm_inputs or [])
        if message := outside_vocabulary(prompt_token_ids, self.vocab_size, "the prompt"):
            raise ValueError(message)
        # a stop id outside the vocabulary could never be generated: it would never fire
        if message := outside_vocabulary(params.stop_token_ids, self.vocab_size,
                                         "stop_token_ids"):
            raise SamplingParamsError(message, "stop_token_ids")
        max_tokens = params.max_tokens
        if num_prompt + (max_tokens or 1) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt} tokens and max_tokens={max_tokens or 1}; together "
                f"they exceed max_model_len={self.max_model_len}. Shorten the prompt, lower "
                "max_tokens, or raise --max-model-len.")
        limit = self.max_model_len if max_tokens is None else num_prompt + max_tokens
        if params.so_args is not None:
            self.structured_output.compile(params.so_args)
        seed = params.resolved_seed()
        if params.seed is None and self.config.model.seed is not None:
            seed = self.config.model.seed
        return Request(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=list(
            prompt_token_ids), sampling_params=params, eos_token_ids=self.eos_token_ids,
            max_total_tokens=limit, seed=seed, kv_transfer_params=kv_transfer_params,
            mm_inputs=list(mm_inputs or ()))

    def _check_image_tokens(self, prompt_token_ids: list[int], mm_inputs: list) -> None:
        """Every image token of the prompt must belong to one of its images (no image tokens
        typed as text, none without embeddings)."""
        num_image_tokens = prompt_token_ids.count(self.mm_processor.image_token_id)
        wanted = sum(image.num_embeds for image in mm_inputs)
        if num_image_tokens != wanted or any(i.end > len(prompt_token_ids)
                                             for i in mm_inputs):
            raise ValueError(f"the prompt holds {num_image_tokens} image tokens but its "
                             f"{len(mm_inputs)} image(s) fill {wanted}; send images as chat "
                             "image parts and do not type image tokens into the text.")

    def add_request(self, request: Request) -> None:
        """Raises QueueFullError when the waiting queue is at its cap. With a KV store, the
        request waits while its stored prompt blocks are fetched."""
        self.scheduler.add_request(request)
        if needs_sync_steps(request.sampling_params):
            self._sync_ids.add(request.request_id)
        self.output_processor.add_request(request.request_id, request.prompt_token_ids,
                                          request.sampling_params, request.arrival_time)
        if self.kv_transfer.add_request(request, self.scheduler.kv_cache_manager):
            self.scheduler.wait_for_remote_kv(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests at once and free their KV blocks (client gone)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.kv_transfer.discard(request_ids)
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished_requests > 0 or self.kv_transfer.has_held_outputs()
                or bool(self._in_flight))

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> execute -> update -> outputs (DESIGN.md).

        With async scheduling the executor returns a future: step N's is resolved here in the
        next call, after step N+1 was launched, so the device does not wait for the host
        (engine/async_step.py). A step that raises is undone and its requests are retried
        alone until the one that fails alone is finished with an error (`_step_failed`)."""
        self._iteration_started = time.perf_counter()
        scheduler_output = self._schedule()
        try:
            if scheduler_output is not None:
                self._launch(scheduler_output)
            overlapping = scheduler_output is not None and self._in_flight[-1].non_block
            resolved = self._resolve(keep=1 if overlapping else 0)
        except EngineDeadError:
            raise   # a worker rank is gone: nothing to retry
        except Exception as error:   # noqa: BLE001 - one request's failure, not the engine's
            resolved, outputs = [], self._step_failed(error)
        else:
            outputs = []
        for step, runner_output in resolved:
            outputs += self._update(step, runner_output)
        ran = [step.scheduler_output for step, _ in resolved]
        ran += [scheduler_output] if scheduler_output is not None else []
        idle = all(out.is_empty for out in ran)
        outputs = self.kv_transfer.end_step(self.scheduler, outputs, idle=idle)
        self._time_blocking_step()
        return outputs

    def _time_blocking_step(self) -> None:
        """The loop iteration ends: where plain steps overlap the host, the blocking step it
        ran (a verify step, or a look that verified nothing) is timed by the whole iteration,
        from its start (the drafter, admission and scheduling before the launch) to now
        (committing and detokenizing after it), as an overlapped plain step is timed by its
        period: priced by its execute time alone, SmolLM2 chat at batch 16 on the H200
        verified at ~3.9 ms a step against 1.26 ms plain periods (0.55x). It starts earlier
        when it drained an overlapped plain step (`_blocking_start`)."""
        if self._untimed is not None:
            scheduler_output, started = self._untimed
            self._untimed = None
            self.spec.observe_time(scheduler_output, time.perf_counter() - started,
                                   measures_plain=False)

    def _non_block(self) -> bool:
        """Launch the next step without waiting for it: async scheduling on, and no running
        request needs each token on the host first, and no fault is being isolated, and
        speculation (varlen) decided at schedule time that the step carries no drafts
        (`_draft_free`)."""
        if self._sync_ids:
            self._sync_ids &= self.scheduler.requests.keys()
        return (self.async_scheduling and not self._sync_ids and not self.faults.isolating
                and self._draft_free)

    def _schedule(self) -> SchedulerOutput | None:
        """The next step's batch, or None: no work, or the step in flight must be resolved
        before a blocking step can be scheduled."""
        # drafts need every token known, so a step that may carry them waits for the one
        # in flight; the decision holds until the step is launched
        self._draft_free = self.spec is None or not self.spec.may_draft(self.scheduler)
        if not self.scheduler.has_work():
            return None
        if self._in_flight and not self._non_block():
            if self._in_flight[-1].non_block:   # drained for the blocking step to come
                self._drained = self._in_flight[-1]
            return None
        isolated = self.faults.current(self.scheduler.requests)
        self.scheduler.isolated_request_id = isolated
        if self.spec is not None and isolated is None:
            if self._non_block():
                self.spec.skip_step(self.scheduler)   # a plain decode step, launched async
            else:
                self.spec.propose(self.scheduler)
        scheduler_output = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.forget(scheduler_output.finished_req_ids)
        if isolated is not None and scheduler_output.is_empty and (
                self.scheduler.requests[isolated].status != RequestStatus.WAITING_FOR_REMOTE_KV):
            self.faults.skip_current()   # no blocks for it alone: back among the others
        return scheduler_output

    def _launch(self, scheduler_output: SchedulerOutput) -> None:
        """Hand the step to the executor. A non-blocking step's sampling rows count their
        tokens as placeholders until its future resolves: 1 for a row scheduled up to its
        last known token, plus its draft tokens for a row scheduled past it."""
        step = _Step(scheduler_output, non_block=(
            self._non_block() and not scheduler_output.scheduled_spec_decode_tokens))
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            step.requests[request_id] = request
            step.num_valid_tokens[request_id] = request.num_computed_tokens - num_tokens
            num_known = request.num_tokens + request.num_output_placeholders
            if step.non_block and request.num_computed_tokens >= num_known:
                step.placeholders[request_id] = request.num_computed_tokens - num_known + 1
                request.num_output_placeholders += step.placeholders[request_id]
        start = time.perf_counter()
        if self._in_flight and self._in_flight[-1].non_block:   # back to back: its period
            self._in_flight[-1].seconds = start - self._in_flight[-1].launched
        self._in_flight.append(step)
        step.launched, step.iteration_started = start, self._blocking_start(step)
        step.output = self.executor.execute(scheduler_output, non_block=step.non_block)
        step.seconds = None if step.non_block else time.perf_counter() - start

    def _blocking_start(self, step: _Step) -> float:
        """When `step`'s time starts: its iteration's start; for a blocking step that drained
        an overlapped plain step (an iteration that only waited for it and committed it, with
        the device idle), the moment that plain step's period would have ended (its launch
        plus the plain step as measured at its batch), if earlier. In a pipeline of
        overlapped steps a step's commit runs while the next one computes; the drain puts it
        on the device's critical path, a cost of the blocking step that its own iteration
        does not show. Only where that plain step's batch was measured (`SpecDecoder.
        plain_period`): a prefill chunk drained by a request's first look would otherwise
        charge the look whatever the chunk took beyond an estimate of it (H100, grounded
        prompts at batch 1: exploration debts of 4 % of the step time, and the drafter
        skipped on 75-98 % of the steps)."""
        drained, self._drained = self._drained, None
        if step.non_block or drained is None or self.spec is None:
            return self._iteration_started
        period = self.spec.plain_period(drained.scheduler_output.total_num_scheduled_tokens)
        if period is None:   # a prefill chunk, or a batch not measured yet
            return self._iteration_started
        return min(self._iteration_started, drained.launched + period)

    def _resolve(self, keep: int) -> list[tuple[_Step, ModelRunnerOutput]]:
        """Wait for the outputs of the steps in flight but the last `keep` (the one just
        launched, when it runs while the host goes on). A step stays in flight until all of
        these resolved: if one raises, `_step_failed` undoes them all."""
        steps = list(self._in_flight)[:len(self._in_flight) - keep]
        resolved = [(step, step.result()) for step in steps]
        for _ in steps:
            self._in_flight.popleft()
        return resolved

    def _update(self, step: _Step, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """A step's end: its placeholders become tokens, the scheduler takes them (rows of
        requests finished or replaced since launch are dropped), the output processor
        detokenizes and applies stop strings."""
        keep = []
        for index, request_id in enumerate(runner_output.req_ids):
            request = self.scheduler.requests.get(request_id)
            if request is None or request is not step.requests.get(request_id):
                continue
            request.num_output_placeholders -= step.placeholders.get(request_id, 0)
            keep.append(index)
        if len(keep) < len(runner_output.req_ids):
            runner_output = ModelRunnerOutput(
                req_ids=[runner_output.req_ids[i] for i in keep],
                sampled_token_ids=[runner_output.sampled_token_ids[i] for i in keep],
                logprobs=[runner_output.logprobs[i] for i in keep] if runner_output.logprobs
                else [])
        num_scheduled = step.scheduler_output.num_scheduled_tokens
        self.faults.step_succeeded({request_id: step.num_valid_tokens[request_id]
                                    + num_scheduled[request_id]
                                    for request_id in runner_output.req_ids})
        core_outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        if self.spec is not None:   # with async scheduling, a plain step's cost is its
            # period when overlapped, not a blocking plain step's (which the loop avoids)
            iteration = self.spec.async_plain_steps and not step.non_block
            self.spec.observe(step.scheduler_output, runner_output,
                              None if iteration else step.seconds,
                              measures_plain=step.non_block or not self.async_scheduling)
            if iteration:   # timed when this iteration ends (`_time_blocking_step`)
                self._untimed = step.scheduler_output, step.iteration_started
        request_outputs, stopped_ids = self.output_processor.process(
            core_outputs, time.monotonic())
        self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    def _step_failed(self, error: Exception) -> list[RequestOutput]:
        """Undo every step in flight (nothing of them was applied: `update_from_output` never
        ran): their requests go back to the queue, as after a preemption, and become suspects
        that run alone; a request that fails alone is finished with an error, its blocks
        freed. Too many failed steps in a row end the engine (`FaultIsolation`)."""
        steps, self._in_flight = list(self._in_flight), deque()
        self.executor.abort()
        num_valid_tokens: dict[str, int] = {}   # computed before the first undone step
        num_reached: dict[str, int] = {}        # ... and where the last was to take them
        for step in steps:
            for request_id, request in step.requests.items():
                if self.scheduler.requests.get(request_id) is request:
                    request.num_output_placeholders = 0
                    num_valid_tokens.setdefault(request_id, step.num_valid_tokens[request_id])
                    num_reached[request_id] = (step.num_valid_tokens[request_id] + step.
                                               scheduler_output.num_scheduled_tokens[request_id])
        self.scheduler.undo_step(num_valid_tokens)
        culprit = self.faults.step_failed(num_reached, error)
        if culprit is None:
            return []
        message = (f"request {culprit} failed inside an engine step ({type(error).__name__}: "
                   f"{str(error)[:200]}); it was stopped and its KV blocks freed, the other "
                   "requests go on. Retrying it will likely fail the same way; the server log "
                   "has the traceback.")
        self.scheduler.finish_requests([culprit], RequestStatus.FINISHED_ERROR)
        self.kv_transfer.discard([culprit])
        outputs, _ = self.output_processor.process(
            [EngineCoreOutput(culprit, [], None, finish_reason="error")], time.monotonic())
        for output in outputs:
            output.error = message
        return outputs

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        stats.kv_store = self.kv_transfer.get_stats()
        if (embedder := self._mm_embedder()) is not None:
            stats.mm_encoder = embedder.snapshot()
        if self.spec is not None:
            stats.spec_decode = self.spec.stats
        return stats


@dataclass
class _Step:
    """A launched step: its batch, the executor's output (or future of it), and what the
    core must undo or settle when it resolves."""

    scheduler_output: SchedulerOutput
    non_block: bool
    output: ModelRunnerOutput | RunnerOutputFuture | None = None
    requests: dict[str, Request] = field(default_factory=dict)  # ids may be reused later
    num_valid_tokens: dict[str, int] = field(default_factory=dict)  # computed before the step
    placeholders: dict[str, int] = field(default_factory=dict)      # tokens in flight per row
    # the step-rate table's time: a blocking step's execute time, a non-blocking one's
    # period (its launch to the next step's, when that came while it was in flight)
    seconds: float | None = None
    launched: float = 0.0   # time.perf_counter() at launch
    iteration_started: float = 0.0   # ... at the start of the step() call that launched it

    def result(self) -> ModelRunnerOutput:
        if isinstance(self.output, ModelRunnerOutput):
            return self.output
        return self.output.result()
