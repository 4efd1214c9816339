"""deepinfer on one GPU: decode and prefill throughput against the roofline and HF transformers.

Builds a Llama-3-8B-shaped model with random bf16 weights on the device (no checkpoint on disk:
HF's `LlamaForCausalLM` is initialised in memory and its state dict is copied into deepinfer's
model, so both run the same weights), then measures in one process:

1. the ceilings: device copy bandwidth (bytes read + written) and the bf16 matmul rate
   (8192^3, random data), as METHOD.md asks;
2. HF transformers `generate` (greedy) at batch 1 and 8, 128-token prompts: decode tokens/s
   from (time for 128 new tokens - time for 1) and prefill tokens/s of 2,048-token prompts;
3. deepinfer's `EngineCore` (KV cache sized by the profiling pass, CUDA graphs for decode):
   decode tokens/s at batch 1, 8, 64, 256 (128-token prompts, 128 new tokens; the timed window
   starts once every request has its first token) and prefill tokens/s of 2,048-token prompts;
4. the same decode runs at b=1, 8, 64 with one kernel choice switched off at a time (each a
   `KernelConfig` built from the engine's, graphs recaptured; `VARIANTS`): no fused GEMMs
   (RMSNorm, SiLU-mul and the residual adds as their own kernels), the attention unfused
   (rotary + KV write, decode and split reduce as three kernels), every linear on cuBLAS, no
   cuBLASLt choice, no programmatic dependent launch, no sums-of-squares handoff between the
   fused GEMMs, the greedy argmax as its own pass over the logits, the 64-row GEMMs in Triton
   (not Gluon). `--variants` picks them, the EXPERIMENTS (PDL release points, Gluon row
   buckets) or any `KernelConfig` setting ("pdl=0", "gluon_block_m=16|32|64", joined by "+");
   `--variants-only` skips everything else;
5. where a decode step's time goes at batch 1, 64 and 256: graph replay alone (the layers, the
   LM head and the greedy argmax: the whole device step), the same step eagerly, the LM head +
   argmax alone (eager), a graph of only the step's matmuls, and per-kernel GPU time of one
   eager step (torch.profiler); with `--profile` also the device timeline of an engine decode
   run at batch 64 (busy and idle time, ops, the largest idle gaps) and CUDA events around each
   of its graph replays (the replay's time in the engine, the time between replays); with
   `--roles`, each variant run also gets each decode-layer kernel's share of the step
   (`layer_roles`: qkv, attention, o, gate_up, down).

Rooflines: decode step = max(bytes / bandwidth, FLOPs / matmul rate), bytes = every weight but
the embedding table (only B rows of it are read) + the KV cache the step reads (B sequences x
the mean context of the timed steps); prefill = FLOPs / matmul rate, FLOPs = 2 x parameters x
tokens (LM head: one row per prompt) + causal attention 2 x L^2 x head_dim per head and layer.

Run: python3 benchmarks/gpu_decode.py [--quick] [--json PATH] [--profile] [--variants A,B]
     [--variants-only] [--variant-batches 64] [--roles]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PROMPT_TOKENS, NEW_TOKENS, PREFILL_TOKENS = 128, 128, 2048
DECODE_BATCHES, HF_BATCHES = (1, 8, 64, 256), (1, 8)


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() over CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_seconds(numel: int) -> float:
    """Median seconds of one device copy of `numel` random bf16 values (freed on return)."""
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _timed(lambda: dst.copy_(src), 20)


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s) on random data."""
    numel = 1 << 31                                       # 4 GiB of bf16
    bandwidth = 2 * numel * torch.bfloat16.itemsize / _copy_seconds(numel)   # read + written
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_s = _timed(lambda: a @ b, 20)
    return {"copy_bandwidth_Bps": bandwidth, "matmul_flops": 2 * 8192 ** 3 / matmul_s}


def write_model_dir(path: Path, hf_config) -> Path:
    """config.json + a word-level tokenizer ("t0".."t{V-1}") for EngineCore; no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(hf_config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1",
                            eos_token="t2").save_pretrained(path)
    hf_config.save_pretrained(path)
    return path


def build_models(hf_config):
    """(HF model, deepinfer model) on CUDA in bf16, holding the same random weights."""
    from transformers import LlamaForCausalLM as HFLlama

    from deepinfer.engine.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf_model = HFLlama(hf_config).eval()
            ours = LlamaForCausalLM(hf_config, torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)
    ours.load_weights(hf_model.state_dict().items())
    return hf_model, ours.eval()


def model_costs(model, hf_config) -> dict:
    """Bytes and FLOPs that set the rooflines (see the module docstring)."""
    embed = model.embed_tokens.weight.numel()
    params = sum(p.numel() for p in model.parameters())
    head = model.lm_head.weight.numel()
    kv_heads, layers = hf_config.num_key_value_heads, hf_config.num_hidden_layers
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return {"weight_bytes": (params - embed) * 2, "matmul_params": params - embed,
            "head_params": head, "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * 2,
            "attn_flops_per_ctx": 4 * layers * hf_config.num_attention_heads * head_dim}


def decode_roofline(costs: dict, ceilings: dict, batch: int, context: float) -> float:
    step_bytes = costs["weight_bytes"] + batch * context * costs["kv_bytes_per_token"]
    step_flops = batch * (2 * costs["matmul_params"] + context * costs["attn_flops_per_ctx"])
    step_s = max(step_bytes / ceilings["copy_bandwidth_Bps"],
                 step_flops / ceilings["matmul_flops"])
    return batch / step_s


def prefill_roofline(costs: dict, ceilings: dict, length: int) -> float:
    flops = (2 * (costs["matmul_params"] - costs["head_params"]) * length
             + 2 * costs["head_params"] + costs["attn_flops_per_ctx"] * length * length / 2)
    return length * ceilings["matmul_flops"] / flops


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


@torch.inference_mode()
def hf_throughput(hf_model, vocab: int, quick: bool) -> dict:
    """HF `generate` decode tokens/s at HF_BATCHES and prefill tokens/s (2,048 tokens)."""
    results = {}
    for batch in HF_BATCHES:
        ids = torch.tensor(_random_prompts(batch, PROMPT_TOKENS, vocab, batch), device="cuda")

        def generate(new_tokens: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        generate(2)  # warm-up
        new_tokens = 32 if quick else NEW_TOKENS
        elapsed = generate(new_tokens) - generate(1)
        results[f"decode_b{batch}"] = batch * (new_tokens - 1) / elapsed
    ids = torch.tensor(_random_prompts(4, PREFILL_TOKENS, vocab, 99), device="cuda")
    seconds = _timed(lambda: hf_model(ids, logits_to_keep=1), 3)
    results["prefill"] = ids.numel() / seconds
    return results


def build_engine(model_dir: Path, model):
    from deepinfer.engine.async_llm import freeze_startup_heap
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.engine_core import EngineCore

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "bfloat16"},
        cache={"enable_prefix_caching": False, "gpu_memory_utilization": 0.9},
        scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "max_waiting_requests": 4096},
        kv_transfer={"kv_store": "none"})
    start = time.perf_counter()
    core = EngineCore(config, model=model)
    freeze_startup_heap()   # as the server does: no collector pauses over the model's objects
    kv = core.executor.runner.kv_caches
    print(f"engine ready in {time.perf_counter() - start:.1f} s: KV cache {kv[0].shape[1]} "
          f"blocks, {len(kv) * kv[0].numel() * 2 / 1e9:.1f} GB, max_model_len "
          f"{core.max_model_len}", flush=True)
    return core


def _run_requests(core, prompts, max_tokens: int) -> tuple[float, int, int]:
    """Submit, then step to completion. Returns (seconds after every request has its first
    token, tokens generated in that window, steps in that window)."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        core.add_request(core.make_request(prompt, params))
    started, total = set(), 0
    while len(started) < len(prompts):
        for out in core.step():
            started.add(out.request_id)
            total += len(out.new_token_ids)
    torch.cuda.synchronize()
    start, before, steps = time.perf_counter(), total, 0
    while core.has_unfinished_requests():
        for out in core.step():
            total += len(out.new_token_ids)
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - start, total - before, steps


def engine_decode(core, batch: int, vocab: int, new_tokens: int) -> dict:
    prompts = _random_prompts(batch, PROMPT_TOKENS, vocab, 1000 + batch)
    seconds, tokens, steps = _run_requests(core, prompts, new_tokens)
    return {"tok_s": tokens / seconds, "step_ms": 1e3 * seconds / max(steps, 1),
            "steps": steps, "tokens": tokens}


def set_async_scheduling(core, enabled: bool) -> None:
    """Switch the idle engine between async (engine/async_step.py) and synchronous steps."""
    assert not core.has_unfinished_requests()
    core.async_scheduling = enabled


def recapture_graphs(core) -> None:
    """Drop the engine's CUDA graphs and capture them again (after a kernel switch changed)."""
    runner = core.executor.runner
    runner.cuda_graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_cuda_graphs(core.config.scheduler.max_num_seqs, core.max_model_len)


# Same-process comparisons: label -> the `KernelConfig` fields it changes (kernels/settings.py);
# the runner hands the config to the model's layers and the graphs are captured again.
# every linear on cuBLAS: the fused and plain Triton skinny GEMMs and the cuBLASLt choice off
CUBLAS_ONLY = {"skinny_max_rows": 0, "cublaslt_max_rows": 0, "fused_linears": False}
VARIANTS = {"unfused": {"fused_linears": False},
            "unfused_attention": {"fused_rotary_decode": False},
            "cublas_linears": CUBLAS_ONLY,
            "no_cublaslt": {"cublaslt_max_rows": 0},
            "no_pdl": {"pdl": False},
            "no_ss_handoff": {"sum_squares_handoff": False},
            "argmax_pass": {"row_argmax_epilogue": False},
            "gluon_off": {"gluon_block_m": frozenset()}}
# experiments (--variants): the committed settings alone (a reference for --variants-only),
# which kernels release the next one right after their PDL wait, which row buckets run Gluon
EXPERIMENTS = {
    "baseline": {},
    "pdl_all_late": {"pdl_release_early": frozenset()},
    "pdl_all_early": {"pdl_release_early": frozenset({"linear", "attention"})},
    "gluon_release_late": {"pdl_release_early": frozenset({"attention"})},
    "gluon_release_all": {"pdl_release_early": frozenset({"attention", "linear_gluon"})},
    "gluon_all_buckets": {"gluon_block_m": frozenset({16, 32, 64})},
}


def variant_fields(label: str) -> dict:
    """The `KernelConfig` fields of variant `label`: a name in VARIANTS / EXPERIMENTS, a
    field setting "FIELD=VALUE" (bool 0/1/true/false, int, or a set as "16|32|64" and "" for
    the empty set), or several of either joined by "+"."""
    from dataclasses import fields

    from deepinfer.kernels.settings import KernelConfig

    types = {f.name: f.type for f in fields(KernelConfig)}
    settings: dict = {}
    for part in label.split("+"):
        if part in VARIANTS or part in EXPERIMENTS:
            settings.update({**VARIANTS, **EXPERIMENTS}[part])
            continue
        name, _, raw = part.partition("=")
        if name not in types or not _:
            raise SystemExit(f"--variants: {part!r} is neither a variant ({', '.join(VARIANTS)}, "
                             f"{', '.join(EXPERIMENTS)}) nor FIELD=VALUE of a KernelConfig field "
                             f"({', '.join(types)})")
        kind = str(types[name])
        settings[name] = (raw.lower() in ("1", "true", "yes", "on") if kind == "bool" else
                          int(raw) if kind == "int" else
                          frozenset(_set_item(v) for v in raw.split("|") if v))
    return settings


def _set_item(value: str):
    return int(value) if value.isdigit() else value


@contextlib.contextmanager
def kernel_settings(core, settings: dict, *, recapture: bool = True):
    """The engine's model runs with `KernelConfig` fields `settings` changed inside (CUDA graphs
    captured again where `recapture`); the engine's own config (and graphs) after."""
    import dataclasses

    runner = core.executor.runner
    committed = runner.kernel_config
    runner.set_kernel_config(dataclasses.replace(committed, **settings))
    try:
        if recapture:
            recapture_graphs(core)
        yield
    finally:
        runner.set_kernel_config(committed)
        if recapture:
            recapture_graphs(core)


def variant_decode(core, vocab: int, new_tokens: int, costs: dict, ceilings: dict,
                   context: float, *, label: str, batches=(1, 8, 64),
                   roles: bool = False) -> dict:
    """Decode at `batches` with variant `label`'s `KernelConfig` (`variant_fields`; graphs
    recaptured), same process and machine; the engine's config (and graphs) are restored
    after. Keys "decode_b{batch}_{label}"; with `roles`, each run also has `layer_roles`'s
    shares."""
    results = {}
    with kernel_settings(core, variant_fields(label)):
        for batch in batches:
            run = engine_decode(core, batch, vocab, new_tokens)
            run["roofline_tok_s"] = decode_roofline(costs, ceilings, batch, context)
            if roles:
                run["layer_roles_us"] = layer_roles(core, batch, vocab)
            results[f"decode_b{batch}_{label}"] = run
            print(f"decode b={batch} {label}: {run}", flush=True)
    return results


def engine_prefill(core, vocab: int, num_prompts: int) -> float:
    """Prefill tokens/s: 2,048-token prompts, one new token each (8,192-token steps)."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = _random_prompts(num_prompts, PREFILL_TOKENS, vocab, 7)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for prompt in prompts:
        core.add_request(core.make_request(prompt, params))
    while core.has_unfinished_requests():
        core.step()
    torch.cuda.synchronize()
    return num_prompts * PREFILL_TOKENS / (time.perf_counter() - start)


class StageTimer:
    """Host wall time per engine stage while active (instance attributes wrap the methods).

    stages: (owner path from the core, method name) pairs (default STAGES); an owner that is
    None (e.g. `spec` without speculation) is left out; times are keyed by method name."""

    STAGES = (("scheduler", "schedule"), ("executor.runner", "execute"),
              ("executor.runner", "execute_async"), ("scheduler", "update_from_output"),
              ("output_processor", "process"))

    def __init__(self, core, stages: tuple[tuple[str, str], ...] | None = None) -> None:
        self.core, self.seconds, self.calls = core, {}, 0
        self.stages = [(owner, name) for owner, name in stages or self.STAGES
                       if self._owner(owner) is not None]

    def __enter__(self) -> "StageTimer":
        for owner, name in self.stages:
            obj = self._owner(owner)
            setattr(obj, name, self._wrap(getattr(obj, name), name))
        return self

    def _wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls += name in ("execute", "execute_async")
        return timed

    def __exit__(self, *exc) -> None:
        for owner, name in self.stages:
            delattr(self._owner(owner), name)

    def _owner(self, path: str):
        obj = self.core
        for attr in path.split("."):
            obj = getattr(obj, attr)
        return obj

    def per_step_ms(self) -> dict:
        return {f"{k}_ms": 1e3 * v / max(self.calls, 1) for k, v in self.seconds.items()}


@torch.inference_mode()
def gemm_only_ms(model, batch: int) -> float:
    """Replay time of a graph holding only the step's matmuls (every Linear of every layer and
    the LM head) at `batch` rows: the floor the rest of the forward adds to."""
    from deepinfer.engine.models.layers.linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features, device="cuda",
                                         dtype=torch.bfloat16) for m in linears}
    for m in linears:
        m(inputs[m.in_features])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m in linears:
            m(inputs[m.in_features])
    return 1e3 * _timed(graph.replay, 20)


@torch.inference_mode()
def kernel_profile(core, batch: int, top: int = 10) -> dict:
    """GPU time per kernel of one eager decode step at `batch` (the graph's work: forward, LM
    head, argmax; torch.profiler), the sum of all kernels, and the heaviest `top` kernels:
    (name, launches, ms) per step. Graph replay minus the kernel sum is the time between
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    graphs = core.executor.runner.cuda_graphs
    size = min(s for s in graphs.batch_sizes if s >= batch)
    repeats = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graphs.step(size)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if _device_us(e) > 0]
    events.sort(key=_device_us, reverse=True)
    return {"kernel_sum_ms": sum(map(_device_us, events)) / repeats / 1e3,
            "kernels": sum(e.count for e in events) // repeats,
            "top": [(e.key[:70], e.count // repeats, round(_device_us(e) / repeats / 1e3, 4))
                    for e in events[:top]]}


def host_profile(core, batch: int, vocab: int, top: int = 15) -> list:
    """cProfile of a decode run at `batch` (32 new tokens): the `top` functions by own time,
    as (file:function, ms per step). Where the host time between GPU steps goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run = engine_decode(core, batch, vocab, 32)
    profiler.disable()
    steps = run["steps"] + 1
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, _)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [(f"{Path(key[0]).name}:{key[2]}", round(1e3 * value[2] / steps, 4))
            for key, value in rows]


def engine_timeline(core, batch: int, vocab: int, top: int = 12) -> dict:
    """The device's timeline over a decode run at `batch` (32 new tokens; torch.profiler, CUDA
    activity only): per step, its busy time (union of kernels and copies) and idle time, the
    device ops by total time, and the largest idle gaps with the ops around them. Where a
    step's time beyond its graph's kernels goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run = engine_decode(core, batch, vocab, 32)
    ops = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == DeviceType.CUDA)
    steps = run["steps"] + 2   # with the first decode step and the prefill
    busy, gaps, end, previous = 0.0, [], ops[0][0], ops[0][2]
    totals: dict[str, list] = {}
    for start, stop, name in ops:
        if start > end:
            gaps.append((start - end, previous, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, previous = stop, name
        entry = totals.setdefault(name[:60], [0, 0.0])
        entry[0] += 1
        entry[1] += stop - start
    gaps.sort(reverse=True)
    by_time = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return {"span_ms": (end - ops[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms_per_step": sum(g[0] for g in gaps) / steps / 1e3, "steps": steps,
            "ops_per_step": [(name, round(count / steps, 2), round(us / steps / 1e3, 4))
                             for name, (count, us) in by_time],
            "largest_gaps_us": [(round(g, 1), before[:40], after[:40])
                                for g, before, after in gaps[:top]]}


LAYER_ROLES = ("qkv", "attention", "o", "gate_up", "down")


def layer_roles(core, batch: int, vocab: int) -> dict:
    """Each decode-layer kernel's share of the step at `batch` (a 32-token engine run under
    torch.profiler): for the kernels of layers 1.. (layer 0's qkv runs another kernel), the
    time from the previous kernel's end to its own end, median over layers and steps, in us.
    Under PDL a kernel's own duration includes its wait for the previous one; this does not,
    so the shares add up to the step's device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine_decode(core, batch, vocab, 32)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and not e.name.startswith("Mem"))
    shares: dict[str, list] = {role: [] for role in LAYER_ROLES}
    for i in range(5, len(kernels) - 3):
        if "rotary_decode" not in kernels[i][2] or "rotary_decode" not in kernels[i - 5][2]:
            continue   # not an attention kernel after a full layer (layer 1 onwards)
        for offset, role in zip(range(-1, 4), LAYER_ROLES):
            shares[role].append(kernels[i + offset][1] - kernels[i + offset - 1][1])
    return {role: round(statistics.median(values), 2) for role, values in shares.items()
            if values}


def _device_us(event) -> float:
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def _breakdown_inputs(graphs, size: int, context: int) -> None:
    """The graph's inputs for timing it alone: `size` rows that each read `context` cached
    tokens through the block tables left in its buffers by the last run, and write no KV."""
    import numpy as np

    from deepinfer.kernels.decode_inputs import pack_decode_inputs

    host = np.zeros(graphs.packed.numel(), dtype=np.int32)
    rows = np.zeros(size, dtype=np.int64)
    used = pack_decode_inputs(host, rows, rows + context - 1, rows - 1, rows + context, None,
                              np.zeros((size, 0), dtype=np.int32))
    graphs.packed[:used].copy_(torch.from_numpy(host[:used]))


def step_timing(core, batch: int, vocab: int) -> dict:
    """CUDA events around each graph replay of an engine decode run at `batch` (64 new tokens):
    the replay's device time in the engine, and the device time from one replay's end to the
    next one's start (the sampled ids' copy out, the next inputs' copy in, the graph launch,
    and any wait for the host), in ms per step."""
    graphs = core.executor.runner.cuda_graphs
    events = []

    class TimedGraph:
        def __init__(self, graph) -> None:
            self.graph = graph

        def replay(self) -> None:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            self.graph.replay()
            end.record()
            events.append((start, end))

    captured = graphs.graphs
    graphs.graphs = {size: TimedGraph(graph) for size, graph in captured.items()}
    try:
        run = engine_decode(core, batch, vocab, 64)
    finally:
        graphs.graphs = captured
    torch.cuda.synchronize()
    replays = [start.elapsed_time(end) for start, end in events]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1)]
    return {"replays": len(replays), "engine_step_ms": run["step_ms"],
            "replay_ms_median": statistics.median(replays),
            "replay_ms_mean": statistics.fmean(replays),
            "gap_ms_median": statistics.median(gaps), "gap_ms_mean": statistics.fmean(gaps),
            "gap_ms_max": max(gaps), "gaps_over_0.1_ms": sum(g > 0.1 for g in gaps),
            "replay_ms_max": max(replays)}


@torch.inference_mode()
def step_breakdown(core, batch: int, context: int) -> dict:
    """Milliseconds of a decode step's parts at `batch` (see the module docstring, point 5)."""
    runner = core.executor.runner
    graphs = runner.cuda_graphs
    size = min(s for s in graphs.batch_sizes if s >= batch)
    _breakdown_inputs(graphs, size, context)
    replay_s = _timed(graphs.graphs[size].replay, 20)
    eager_s = _timed(lambda: graphs.step(size), 10)
    hidden = graphs.outputs[size].hidden[:batch]
    head_s = _timed(lambda: runner.model.compute_logits(hidden).argmax(dim=-1), 20)
    return {"graph_replay_ms (layers + lm_head + argmax)": 1e3 * replay_s,
            "eager_step_ms": 1e3 * eager_s, "lm_head_argmax_eager_ms": 1e3 * head_s,
            "gemm_only_ms (layers + lm_head)": gemm_only_ms(runner.model, batch),
            "gemm_only_cublas_ms": _cublas_only(core, lambda: gemm_only_ms(runner.model, batch))}


def _cublas_only(core, fn):
    """fn() with every linear on cuBLAS (`CUBLAS_ONLY`), for comparison."""
    with kernel_settings(core, CUBLAS_ONLY, recapture=False):
        return fn()


def diagnostics(core, context: int, vocab: int, profile: bool) -> dict:
    """Step breakdowns at b=1, 64, 256; with `profile`, kernel and host profiles too."""
    results = {}
    for batch in (1, 64, 256):
        results[f"breakdown_b{batch}"] = step_breakdown(core, batch, context)
        print(f"step breakdown b={batch}: {results[f'breakdown_b{batch}']}", flush=True)
        if profile:
            results[f"kernels_b{batch}"] = kernel_profile(core, batch)
            print(f"kernels b={batch}: {json.dumps(results[f'kernels_b{batch}'])}", flush=True)
    if profile:
        results["step_timing_b64"] = step_timing(core, 64, vocab)
        print(f"step timing b=64: {json.dumps(results['step_timing_b64'])}", flush=True)
        results["timeline_b64"] = engine_timeline(core, 64, vocab)
        print(f"timeline b=64: {json.dumps(results['timeline_b64'])}", flush=True)
        results["host_profile_b64"] = host_profile(core, 64, vocab)
        print(f"host profile b=64 (ms/step): {json.dumps(results['host_profile_b64'])}",
              flush=True)
    return results


def print_table(rows: list[tuple[str, float, float, float | None]]) -> None:
    """Markdown table of (name, tok/s, roofline tok/s, HF tok/s or None) rows."""
    print("\n| measurement | deepinfer tok/s | roofline tok/s | fraction of roofline | "
          "HF tok/s | deepinfer / HF |\n|---|---|---|---|---|---|")
    for name, tok_s, roof, hf_tok_s in rows:
        ratio = f"{tok_s / hf_tok_s:.1f}x" if hf_tok_s else "-"
        hf_text = f"{hf_tok_s:.1f}" if hf_tok_s else "-"
        print(f"| {name} | {tok_s:.1f} | {roof:.1f} | {tok_s / roof:.2f} | {hf_text} | {ratio} |")


def main_measurements(core, hf_config, hf: dict, costs: dict, ceilings: dict, context: float,
                      new_tokens: int, results: dict, profile: bool) -> list:
    """Decode at DECODE_BATCHES (async, then sync steps), prefill and the diagnostics, into
    `results`; returns the table's rows."""
    rows = []
    for batch in DECODE_BATCHES:
        with StageTimer(core) as timer:
            run = engine_decode(core, batch, hf_config.vocab_size, new_tokens)
        run["host_stages"] = timer.per_step_ms()
        roof = decode_roofline(costs, ceilings, batch, context)
        hf_tok_s = hf.get(f"decode_b{batch}")
        rows.append((f"decode b={batch}", run["tok_s"], roof, hf_tok_s))
        results[f"decode_b{batch}"] = {**run, "roofline_tok_s": roof}
        print(f"decode b={batch}: {run}", flush=True)
    for batch in (1, 64, 256):                                # before/after async scheduling
        set_async_scheduling(core, False)
        run = engine_decode(core, batch, hf_config.vocab_size, new_tokens)
        roof = decode_roofline(costs, ceilings, batch, context)
        rows.append((f"decode b={batch} (sync steps)", run["tok_s"], roof, None))
        results[f"decode_b{batch}_sync"] = {**run, "roofline_tok_s": roof}
        print(f"decode b={batch} sync steps: {run}", flush=True)
    set_async_scheduling(core, True)
    prefill = engine_prefill(core, hf_config.vocab_size, 8)
    roof = prefill_roofline(costs, ceilings, PREFILL_TOKENS)
    rows.append((f"prefill {PREFILL_TOKENS}", prefill, roof, hf["prefill"]))
    results["prefill"] = {"tok_s": prefill, "roofline_tok_s": roof}
    results.update(diagnostics(core, int(context), hf_config.vocab_size, profile))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--profile", action="store_true",
                        help="also list the heaviest GPU kernels of a decode forward")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated VARIANTS / EXPERIMENTS or KernelConfig settings "
                             "FIELD=VALUE ('+' joins several into one variant) to run "
                             "(default: all VARIANTS; '' for none)")
    parser.add_argument("--variants-only", action="store_true",
                        help="build the engine and run only the variants")
    parser.add_argument("--variant-batches", default="1,8,64",
                        help="comma-separated batch sizes of the variant runs")
    parser.add_argument("--roles", action="store_true",
                        help="also time each decode-layer kernel's share in the variant runs")
    args = parser.parse_args()
    for label in filter(None, args.variants.split(",")):
        variant_fields(label)   # an unknown name stops here, before minutes of set-up
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**LLAMA3_8B)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["ceilings"] = ceilings = measure_ceilings()
    print(f"copy bandwidth {ceilings['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    start = time.perf_counter()
    hf_model, ours = build_models(hf_config)
    costs = model_costs(ours, hf_config)
    print(f"models built in {time.perf_counter() - start:.1f} s; weights read per step "
          f"{costs['weight_bytes'] / 1e9:.2f} GB", flush=True)
    hf = {}
    if not args.variants_only:
        results["hf"] = hf = hf_throughput(hf_model, hf_config.vocab_size, args.quick)
        print(f"HF: {json.dumps({k: round(v, 1) for k, v in hf.items()})}", flush=True)
    del hf_model
    gc.collect()
    torch.cuda.empty_cache()

    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="llama3-8b-random-")), hf_config)
    core = build_engine(model_dir, ours)
    new_tokens = 32 if args.quick else NEW_TOKENS
    engine_decode(core, 8, hf_config.vocab_size, 8)          # warm-up: prefill kernel compiles
    engine_prefill(core, hf_config.vocab_size, 4)
    rows = []
    context = PROMPT_TOKENS + new_tokens / 2                  # mean context of the timed steps
    if not args.variants_only:
        rows = main_measurements(core, hf_config, hf, costs, ceilings, context, new_tokens,
                                 results, args.profile)
    for label in filter(None, args.variants.split(",")):
        variant = variant_decode(core, hf_config.vocab_size, new_tokens, costs, ceilings,
                                 context, label=label,
                                 batches=[int(b) for b in args.variant_batches.split(",")],
                                 roles=args.roles)
        results.update(variant)
        for key, run in variant.items():
            batch = key.split("_")[1]
            rows.append((f"decode {batch.replace('b', 'b=')} ({label.replace('_', ' ')})",
                         run["tok_s"], run["roofline_tok_s"], None))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
