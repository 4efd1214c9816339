"""Structured outputs: both grammar backends (XGrammar, LLGuidance) and "auto" over JSONSchemaBench,
and the cost of a JSON-schema constraint on end-to-end decode throughput.

    python benchmarks/bench_structured.py [--per-split 0] [--walk-tokens 64] [--new-tokens 64]

1. Coverage: every schema of each vendored JSONSchemaBench split (Geng et al. 2025;
   `--per-split N` takes N evenly spaced ones) plus the hand-written kinds of
   tests/engine/structured_schemas.py, compiled with the SmolLM2 tokenizer under each backend:
   share compiled per split (the rest get clear 400s), compile time mean / p99 / max.
   Target: >= 97% across the splits under auto.
2. Mask time: per compiled schema a random walk of up to `--walk-tokens` tokens under the
   grammar (allowed tokens at random, preferring ones that close strings and containers); each
   bitmask fill is timed, bounded-number wrapper included. Mean and p99 in us per backend
   (target: p99 <= 500 us). Walks that end are validated with jsonschema, formats checked
   (target: 0 invalid).
3. Decode: SmolLM2-135M in-process, 16 concurrent requests (one batch), greedy, `--new-tokens`
   each, unconstrained vs constrained to a JSON schema whose outputs run long, per backend;
   tokens/s = generated tokens / wall time, and the slowdown (target: <= 10%).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

LONG_SCHEMA = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["notes"]}
BACKENDS = ("xgrammar", "guidance", "auto")


def corpus(per_split: int) -> dict[str, dict]:
    from structured_schemas import (BENCH_DIR, BENCH_SPLITS, HAND_WRITTEN, ISSUE_KINDS,
                                    bench_sample)
    if per_split:
        schemas = bench_sample(per_split)
    else:
        schemas = {f"{split}/{path.stem}": json.loads(path.read_text())
                   for split in BENCH_SPLITS for path in sorted((BENCH_DIR / split).glob("*.json"))}
    return {**schemas, **{f"hand/{k}": v for k, v in {**HAND_WRITTEN, **ISSUE_KINDS}.items()}}


def backend_stats(manager, tokenizer, schemas: dict[str, dict], backend: str,
                  walk_tokens: int) -> None:
    import jsonschema
    from deepinfer.engine.structured import GrammarError
    from structured_schemas import random_walk
    from test_structured_backends import format_checker

    eos = [tokenizer.eos_token_id]
    closing = {i for i in range(len(tokenizer))
               if any(c in tokenizer.decode([i]) for c in '"}],')}
    rng = random.Random(0)
    per_split: dict[str, list[int]] = {}
    compile_s, mask_s, finished, invalid, picked = [], [], 0, [], {}
    for name, schema in schemas.items():
        split = name.split("/")[0]
        counts = per_split.setdefault(split, [0, 0])
        counts[1] += 1
        so_args = {"schema_type": "json", "schema": schema, "backend": backend}
        start = time.perf_counter()
        try:
            compiled = manager.compile(so_args)
        except GrammarError:
            continue
        compile_s.append(time.perf_counter() - start)
        counts[0] += 1
        picked[compiled.backend] = picked.get(compiled.backend, 0) + 1
        tokens, done = random_walk(manager, so_args, eos, rng, walk_tokens, closing,
                                   timings=mask_s)
        if done:
            finished += 1
            try:
                jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema,
                                    format_checker=format_checker())
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                invalid.append((name, str(exc)[:120]))
    bench = {k: v for k, v in per_split.items() if k != "hand"}
    accepted, total = sum(c[0] for c in bench.values()), sum(c[1] for c in bench.values())
    splits = ", ".join(f"{k} {c[0]}/{c[1]} ({c[0] / c[1]:.1%})" for k, c in per_split.items())
    ms, us = np.array(compile_s) * 1e3, np.array(mask_s) * 1e6
    print(f"[{backend}] coverage: {splits}; JSONSchemaBench {accepted}/{total} "
          f"({accepted / total:.1%}; target >= 97%)" + (f"; compiled by {picked}"
                                                         if backend == "auto" else ""))
    print(f"[{backend}] compile: mean {ms.mean():.1f} ms, p99 {np.percentile(ms, 99):.0f} ms, "
          f"max {ms.max():.0f} ms")
    print(f"[{backend}] mask fill: {len(us)} tokens; mean {us.mean():.1f} us, p50 "
          f"{np.percentile(us, 50):.1f} us, p99 {np.percentile(us, 99):.1f} us "
          "(target p99 <= 500 us)")
    print(f"[{backend}] outputs: {finished} walks ended; {len(invalid)} invalid (target 0)"
          + (f": {invalid[:3]}" if invalid else ""))


def corpus_stats(per_split: int, walk_tokens: int) -> None:
    from deepinfer.engine.loader import load_tokenizer, resolve_model_dir
    from deepinfer.engine.structured.manager import grammar_manager

    tokenizer = load_tokenizer(resolve_model_dir(None, None))
    schemas = corpus(per_split)
    for backend in BACKENDS:   # a fresh manager each: no compile is a cache hit
        manager = grammar_manager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        backend_stats(manager, tokenizer, schemas, backend, walk_tokens)


def decode_throughput(new_tokens: int, concurrency: int, rounds: int) -> None:
    from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    llm = LLM(config=EngineConfig(model=ModelConfig(device="cpu"),
                                  cache=CacheConfig(num_blocks=2048)))
    prompts = [llm.tokenizer.encode(f"Write {i + 3} short notes about the sea as JSON.")
               for i in range(concurrency)]
    runs = {"unconstrained": SamplingParams(temperature=0, max_tokens=new_tokens,
                                            ignore_eos=True)}
    for backend in ("xgrammar", "guidance"):
        runs[backend] = SamplingParams(temperature=0, max_tokens=new_tokens, so_args={
            "schema_type": "json", "schema": LONG_SCHEMA, "backend": backend})
    llm.generate(prompts[:3], list(runs.values()))                 # warm-up, compile
    rates: dict[str, float] = {}
    for _ in range(rounds):   # alternate, keep the best of each: the machine may be shared
        for label, params in runs.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            generated = sum(len(o.token_ids) for o in outputs)
            rates[label] = max(rates.get(label, 0.0), generated / elapsed)
    for label, rate in rates.items():
        print(f"decode {label:>13}: {rate:.1f} tok/s ({concurrency} concurrent, "
              f"{new_tokens} tokens each, best of {rounds})")
    for backend in ("xgrammar", "guidance"):
        slowdown = 1 - rates[backend] / rates["unconstrained"]
        print(f"constraint slowdown [{backend}]: {slowdown:.1%} (target <= 10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-split", type=int, default=0, help="0: every schema")
    parser.add_argument("--walk-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    corpus_stats(args.per_split, args.walk_tokens)
    if not args.skip_decode:
        decode_throughput(args.new_tokens, args.concurrency, args.rounds)


if __name__ == "__main__":
    main()
