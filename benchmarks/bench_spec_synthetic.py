"""Speedup of speculative decoding against acceptance rate and batch size, fixed vs varlen
(DSpark) admission, on DeepSeek-V2-Lite-shaped random weights with a synthetic drafter
(issue 30, GPU chart).

Target: DeepSeek-V2-Lite's shapes (hidden 2048, 16 heads, MLA kv_lora 512 + rope 64, layer 0
dense, then 64 routed experts top-6 + 2 shared, vocab 102400) with the first `--layers` layers
(default 8: one dense + seven MoE), random bf16 weights built on the device
(benchmarks/gpu_deepseek.py). Decode and verify steps replay CUDA graphs.

Drafter (`SyntheticDrafter`, here and not in engine/spec: no real config uses it): a plain run
gives each prompt's greedy continuation (the oracle); at output position i the drafter proposes
gamma drafts where draft j is the oracle token i + j with probability p, else another token
(independent per position, keyed by (prompt, i, j), so reruns draw the same), and confidence p
at every position: P(draft j accepted | drafts before it were) = p exactly, a calibrated
confidence by construction. "mix" gives alternate requests p = 0.95 and p = 0.25 (mean 0.6):
the case varlen admission exists for (spend verify tokens on the requests that accept). A
request whose committed tokens leave its oracle (a bf16 near tie that the verify kernel rounds
the other way) gets wrong drafts from then on; the JSON counts them (`diverged`) and the
measured acceptance is reported beside p. Plain random bf16 weights have near-flat logits, and
every request left its oracle within a token or two (H200, 2026-12-04: acceptance ~0), so the
weights are made peaked first (`peak_logits`: the input token's embedding dominates the residual
stream and the LM head holds the embeddings permuted, so greedy decoding follows a fixed token
permutation with a margin ~40x the logits' spread); the model's shapes and work per step are
unchanged.

Reports per (p, batch, engine): decode tokens/s (after every request has its first token; the
best of two runs, then a third gives the counters),
speedup against speculation off at the same batch, mean accepted length (1 + accepted /
verify rows with drafts), acceptance per position, and the mean drafts verified per row.

    python3 benchmarks/bench_spec_synthetic.py [--layers 8] [--batches 1,16,64]
        [--acceptance 0.6,0.9,0.3,mix] [--gamma 5] [--new-tokens 64] [--json PATH]
    python3 benchmarks/bench_spec_synthetic.py --tiny   # CPU dry run: tiny shapes, float32
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import _random_prompts, write_model_dir  # noqa: E402
from gpu_deepseek import V2_LITE, build_models  # noqa: E402

from deepinfer.engine.spec.drafter import DraftProposal, DraftRequest  # noqa: E402

MIX = (0.95, 0.25)
TINY = dict(V2_LITE, vocab_size=512, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)


EMBED_SCALE = 1000.0   # the embeddings' growth in `peak_logits` (residual stream ~ embedding)


def peak_logits(model, seed: int = 0) -> None:
    """Greedy decoding robust to rounding, in place: embeddings x EMBED_SCALE (the residual
    stream is then the input token's embedding plus comparatively small layer outputs), and the
    LM head = the original embeddings permuted, so token t's logits peak at the row holding t's
    embedding: a margin of ~hidden x std^2 / std (~40 at V2-Lite's shapes) against a spread of
    ~1, where bf16 rounding moves logits by << 1. With a tied LM head the permutation is
    skipped (greedy then repeats the input token)."""
    with torch.no_grad():
        embeddings = model.embed_tokens.weight
        original = embeddings.detach().clone()
        embeddings.mul_(EMBED_SCALE)
        if model.lm_head.weight.data_ptr() != embeddings.data_ptr():
            gen = torch.Generator().manual_seed(seed)
            perm = torch.randperm(original.shape[0], generator=gen).to(original.device)
            model.lm_head.weight.copy_(original[perm])


class SyntheticDrafter:
    """Drafts of controlled acceptance (module docstring); the engine/spec Drafter protocol.

    Args:
        oracle: prompt token ids (tuple) -> the target's greedy continuation.
        rate: prompt -> p, the per-position acceptance probability of that request's drafts.
        vocab_size: token ids are drawn below it.
        seed: the draws' key.
    """

    def __init__(self, oracle: dict[tuple, list[int]], rate: dict[tuple, float],
                 vocab_size: int, seed: int = 0):
        self.oracle, self.rate, self.vocab_size, self.seed = oracle, rate, vocab_size, seed
        self.diverged: set[tuple] = set()

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, DraftProposal]:
        proposals = {}
        for request in requests:
            prompt = tuple(request.token_ids[:request.num_prompt_tokens])
            expected, p = self.oracle[prompt], self.rate[prompt]
            output = list(request.token_ids[request.num_prompt_tokens:])
            done = len(output)
            if output != expected[:done]:
                self.diverged.add(prompt)
            drafts = []
            for j in range(request.max_drafts):
                token = expected[done + j] if done + j < len(expected) else 0
                # one 64-bit draw keyed by (seed, prompt, i, j): a uniform from its low 32
                # bits, a wrong token's offset from its high bits (a Random() per draft cost
                # ~1 ms of host time per step at batch 64)
                draw = hash((self.seed, prompt[:8], done, j)) & (2**64 - 1)
                if (draw & 0xFFFFFFFF) / 2**32 >= p:   # a wrong draft: any other id
                    offset = 1 + (draw >> 32) % (self.vocab_size - 1)
                    token = (token + offset) % self.vocab_size
                drafts.append(token)
            proposals[request.request_id] = DraftProposal(drafts, [p] * len(drafts))
        return proposals

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        """Confidences are exact by construction: nothing to learn."""

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""


def build_core(model_dir: Path, model, *, device: str, dtype: str, max_num_seqs: int,
               gamma: int, spec: str | None, kv_bytes: int):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.engine_core import EngineCore

    speculative = ({"speculative_method": "ngram", "spec_varlen": spec == "varlen",
                    "num_speculative_tokens": gamma} if spec else {})
    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": device, "dtype": dtype},
        cache={"enable_prefix_caching": False, "kv_cache_memory_bytes": kv_bytes},
        scheduler={"max_num_seqs": max_num_seqs,
                   "max_num_batched_tokens": max(2048, max_num_seqs * (1 + gamma))},
        kv_transfer={"kv_store": "none"}, speculative=speculative)
    start = time.perf_counter()
    core = EngineCore(config, model=model)
    runner = core.executor.runner
    print(f"engine {spec or 'off'} ready in {time.perf_counter() - start:.1f} s (decode graphs "
          f"{runner.cuda_graphs is not None}, verify graph buckets "
          f"{getattr(runner.verify_graphs, 'token_buckets', None)})", flush=True)
    return core


def run_batch(core, prompts: list[list[int]], new_tokens: int, sync) -> dict:
    """Greedy, ignore_eos: (decode seconds after every request has its first token, tokens in
    that window, each prompt's output ids)."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = {}
    for prompt in prompts:
        request = core.make_request(prompt, params)
        ids[request.request_id] = tuple(prompt)
        core.add_request(request)
    outputs = {prompt: [] for prompt in ids.values()}
    started, total = set(), 0
    while len(started) < len(prompts):
        for out in core.step():
            started.add(out.request_id)
            outputs[ids[out.request_id]] += out.new_token_ids
    sync()
    start, before = time.perf_counter(), sum(len(o) for o in outputs.values())
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[ids[out.request_id]] += out.new_token_ids
    sync()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(o) for o in outputs.values()) - before,
            "outputs": outputs}


def best_of(repeats: int, run) -> dict:
    """The fastest of `repeats` calls of run() (each returns run_batch's dict)."""
    return min((run() for _ in range(repeats)), key=lambda r: r["seconds"])


def stats_delta(core, before) -> dict:
    after = core.spec.stats
    rows = after.num_drafts - before[0]
    drafts = after.num_draft_tokens - before[1]
    accepted = after.num_accepted_tokens - before[2]
    per_pos = [a - b for a, b in zip(after.num_accepted_tokens_per_pos, before[3])]
    return {"verify_rows_with_drafts": rows,
            "drafts_per_row": round(drafts / rows, 3) if rows else 0.0,
            "mean_accepted_length": round(1 + accepted / rows, 3) if rows else None,
            "acceptance_per_position": [round(c / rows, 3) for c in per_pos] if rows else []}


def snapshot(core):
    s = core.spec.stats
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
            list(s.num_accepted_tokens_per_pos))


def expected_length(rates: list[float], gamma: int) -> float:
    """Mean over requests of 1 + sum_{j<=gamma} p^j: the committed tokens per verify row when
    every row verifies gamma drafts (fixed admission, no cap)."""
    return sum(1 + sum(p ** j for j in range(1, gamma + 1)) for p in rates) / len(rates)


def parse_rates(text: str) -> list[str]:
    return [r.strip() for r in text.split(",") if r.strip()]


def rates_for(name: str, prompts: list[tuple]) -> dict[tuple, float]:
    if name == "mix":
        return {p: MIX[i % 2] for i, p in enumerate(prompts)}
    return {p: float(name) for p in prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--acceptance", default="0.6,0.9,0.3,mix")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny shapes, float32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import DeepseekV2Config

    device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    shapes = dict(TINY if args.tiny else V2_LITE, num_hidden_layers=args.layers)
    hf_config = DeepseekV2Config(**shapes)
    batches = [int(b) for b in args.batches.split(",")]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="spec-synthetic-")), hf_config)
    _, model = build_models(hf_config, with_hf=False, device=device,
                            dtype=getattr(torch, dtype))
    peak_logits(model)
    gc.collect()
    prompts = {b: _random_prompts(b, args.prompt_tokens, shapes["vocab_size"], 500 + b)
               for b in batches}
    kv_bytes = int(args.kv_gib * 2**30)
    common = dict(device=device, dtype=dtype, max_num_seqs=max(batches), gamma=args.gamma,
                  kv_bytes=kv_bytes)
    results = {"layers": args.layers, "gamma": args.gamma, "new_tokens": args.new_tokens,
               "prompt_tokens": args.prompt_tokens, "device": device, "dtype": dtype,
               "off": {}, "runs": []}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    off = build_core(model_dir, model, spec=None, **common)
    oracle = {}
    for batch in batches:   # a warm-up, then the timed run, whose outputs are the oracle
        run_batch(off, prompts[batch][:1], 4, sync)
        run = best_of(2, lambda: run_batch(off, prompts[batch], args.new_tokens, sync))
        oracle.update(run["outputs"])
        results["off"][batch] = {"tok_s": round(run["tokens"] / run["seconds"], 1)}
        print(json.dumps({"engine": "off", "batch": batch, **results["off"][batch]}), flush=True)
    save()
    cores = {spec: build_core(model_dir, model, spec=spec, **common)
             for spec in ("fixed", "varlen")}
    results["varlen_step_ms_start_up"] = cores["varlen"].spec.step_rate.as_milliseconds()
    all_prompts = [tuple(p) for b in batches for p in prompts[b]]
    for rate in parse_rates(args.acceptance):   # engines interleaved: a cut run keeps pairs
        for batch in batches:
            for spec, core in cores.items():
                drafter = SyntheticDrafter(oracle, rates_for(rate, all_prompts),
                                           shapes["vocab_size"])
                core.spec.drafter = drafter
                run_batch(core, prompts[batch][:1], 4, sync)   # warm-up
                run = best_of(2, lambda: run_batch(core, prompts[batch], args.new_tokens, sync))
                before = snapshot(core)   # the counters of one more run, untimed
                drafter.diverged.clear()
                run_batch(core, prompts[batch], args.new_tokens, sync)
                tok_s = run["tokens"] / run["seconds"]
                row = {"engine": spec, "acceptance": rate, "batch": batch,
                       "tok_s": round(tok_s, 1),
                       "speedup": round(tok_s / results["off"][batch]["tok_s"], 3),
                       **stats_delta(core, before),
                       "expected_accepted_length_at_gamma": round(expected_length(
                           [drafter.rate[tuple(p)] for p in prompts[batch]], args.gamma), 3),
                       "diverged": len(drafter.diverged),
                       "same_tokens_as_off": all(run["outputs"][tuple(p)] == oracle[tuple(p)]
                                                 for p in prompts[batch])}
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
                save()
    save()


if __name__ == "__main__":
    main()
