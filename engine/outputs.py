"""The seams of one engine step, as plain data (no tensors, no torch import).

- `SchedulerOutput` — made by `Scheduler.schedule()`, read by `ModelRunner.execute()`. Ids,
  counts and integer block ids only; the runner turns them into tensors.
- `ModelRunnerOutput` — made by `ModelRunner.execute()`, read by
  `Scheduler.update_from_output()`. Python lists of sampled ids and logprobs.
- `EngineCoreOutput` — one per request per step with its new tokens, made by the scheduler and
  turned into text by the `OutputProcessor`.
- `RequestOutput` — what `LLM.generate` returns and `AsyncLLM.generate` streams: per-step deltas
  (`new_token_ids`, `new_text`) plus the running totals a client needs.

Ownership: the step loop (EngineCore) owns every object here until it hands a `RequestOutput` to
the caller; nothing here is mutated after that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    request_id: str
    token_ids: list[int]          # prompt + output tokens so far
    num_prompt_tokens: int
    block_ids: list[int]          # the whole block table
    num_computed_tokens: int      # tokens already in the KV cache (prefix-cache hits)
    sampling_params: SamplingParams
    seed: int
    mm_inputs: list = field(default_factory=list)   # engine.multimodal.ImageInput, placed


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    request_id: str
    new_block_ids: list[int]      # appended to its block table
    num_computed_tokens: int
    # set after rejected draft tokens freed lookahead blocks (Scheduler.update_from_output):
    # the runner cuts its block table to this many ids before appending new_block_ids
    num_kept_block_ids: int | None = None


@dataclass
class KVBlocks:
    """Blocks of one request to move between the KV cache and the KV store this step:
    `block_ids[i]` holds the block whose hash is `block_hashes[i]`."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[int]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    # KV store traffic (engine/kv_transfer.py): fill these blocks from the store before the
    # forward pass; copy these full prompt blocks out to the store after it
    kv_loads: list[KVBlocks] = field(default_factory=list)
    kv_saves: list[KVBlocks] = field(default_factory=list)
    # speculative decoding: request id -> the k draft token ids scheduled after its last
    # sampled token (its row scores 1 + k tokens; num_scheduled_tokens counts them). Only
    # requests with drafts appear; empty on the default path.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # multimodal: request id -> indices of its images (`NewRequestData.mm_inputs`) whose
    # placeholder tokens this step computes: the runner encodes (or finds) them first
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own and the top-k alternatives (id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in `req_ids` order. A request whose prefill chunk did not reach the
    end of its tokens samples nothing (empty list).

    A row that scored k draft tokens (`SchedulerOutput.scheduled_spec_decode_tokens`) returns
    its committed tokens: the target's own samples at positions 0..m, where the first m drafts
    equal the samples before them (accepted) and the (m+1)-th is the correction or, m = k, the
    bonus token. So 1 <= len <= 1 + k, and the scheduler rolls back k - m positions. The
    logprobs list holds one entry per committed token.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None   # stop token id or stop string that ended it
    num_cached_tokens: int = 0             # prompt tokens served by the prefix cache


@dataclass
class CompletionOutput:
    """One finished sequence, in the shape vLLM's offline API returns (`RequestOutput.outputs`)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """Monotonic timestamps in seconds (time.monotonic)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    num_output_tokens: int
    num_cached_tokens: int
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    metrics: RequestMetrics
    # Filled only when finished (offline API): the whole generation.
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprobs] | None = None
    # prefill/decode disaggregation: what a do_remote_decode request stored (final output only)
    kv_transfer_params: dict | None = None
    # offline API with n > 1: the n finished choices (each ran as its own engine request)
    choices: list[CompletionOutput] | None = None
    # finish_reason "error": what failed (a step failed on this request alone; EngineCore)
    error: str | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's spelling of the finished generation: `out.outputs[i].text` for choice i (n
        of them offline with SamplingParams.n = n; empty until the request has finished)."""
        if self.choices is not None:
            return self.choices
        if self.text is None:
            return []
        return [CompletionOutput(0, self.text, list(self.token_ids or []), self.logprobs,
                                 self.finish_reason, self.stop_reason)]


@dataclass
class SchedulerStats:
    """A snapshot of the step loop's gauges and counters (for /metrics)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0           # fraction of KV blocks in use, 0..1
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0         # prompt tokens looked up (counter)
    prefix_cache_hits: int = 0            # of which served from cache (counter)
    num_preemptions: int = 0              # counter
    kv_store: "KVStoreStats | None" = None  # None when no KV store is configured
    mm_encoder: "MMEncoderStats | None" = None  # None for a text-only model
    # attention data parallelism: each rank's own (engine/dp_scheduler.py); None with one rank
    per_rank: "list[SchedulerStats] | None" = None
    spec_decode: "SpecDecodeStats | None" = None  # None when speculative decoding is off


@dataclass
class MMEncoderStats:
    """Counters of a multimodal model's image encoder (engine/mm_encoder.py), for /metrics."""

    images_encoded: int = 0        # images run through the vision tower here
    cache_hits: int = 0            # image embeddings served by the encoder cache
    store_hits: int = 0            # image embeddings loaded from the KV store's namespace
    store_misses: int = 0          # looked up in the store and not usable (absent, corrupt)
    store_corrupt: int = 0         # of the misses: values that failed to decode
    store_saves: int = 0           # embeddings written to the store
    encode_seconds: float = 0.0    # time spent encoding (sum)
    cache_bytes: int = 0           # encoder cache occupancy (gauge)


@dataclass
class KVStoreStats:
    """Counters of the KV block store traffic (engine/kv_transfer.py), for /metrics.

    Latency histograms are cumulative bucket counts over `latency_buckets_s` (upper bounds, in
    seconds; the last bucket is +Inf) plus the sum of observations, as Prometheus wants them.
    """

    hits: int = 0              # blocks loaded from the store
    misses: int = 0            # blocks looked up and not loaded (absent, corrupt, store down)
    corrupt: int = 0           # of the misses: values that failed to decode or did not fit
    errors: int = 0            # store operations that failed (unreachable, timeout)
    bytes_loaded: int = 0
    bytes_saved: int = 0
    blocks_saved: int = 0
    latency_buckets_s: tuple[float, ...] = ()
    load_latency_counts: tuple[int, ...] = ()   # cumulative, len(latency_buckets_s) + 1
    load_latency_sum_s: float = 0.0
    save_latency_counts: tuple[int, ...] = ()
    save_latency_sum_s: float = 0.0


@dataclass
class SpecDecodeStats:
    """Counters of speculative decoding (engine/spec/manager.py), for /metrics (vLLM's names).

    num_drafts: verify rows with at least one draft; num_draft_tokens: drafts verified;
    num_accepted_tokens: drafts accepted; num_accepted_tokens_per_pos[j]: rows whose draft at
    0-based position j was accepted (so [0] / num_drafts is the first draft's acceptance)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify row: 1 + accepted drafts per row (0 before any row)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
