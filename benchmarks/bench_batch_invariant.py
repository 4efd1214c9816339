"""The batch-invariant mode (`--batch-invariant`, `KernelConfig.batch_invariant`): how many
distinct outputs one prompt gets under varying load, and what the mode costs.

1. Distinct outputs (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025:
   1,000 completions of one prompt at temperature 0; 80 distinct on vLLM, 1 with their
   batch-invariant kernels). Here `--completions` copies of one prompt, greedy with top-5
   logprobs, run in rounds of `--per-round` copies, each round beside a fresh random load
   (0..`--max-load` other requests of random prompt and output lengths, seeded), so the batch
   around a copy changes: its size, its neighbours, its prefill chunks, its prefix-cache hits.
   Counted with the mode off and on: distinct token sequences, and distinct (tokens, logprob
   floats) pairs.
2. Cost: decode tokens/s at each batch size of `--batches`, off and on, interleaved
   `--repeats` times (best of each): B fresh random prompts of `--prompt-len` tokens,
   (time of 1 + T new tokens) - (time of 1 new token) over B x T tokens.

Usage: python benchmarks/bench_batch_invariant.py [--model PATH] [--device cuda] [--json OUT]
The cost at Llama-3-8B's and DeepSeek-V2-Lite's shapes (random weights built on the GPU):
`gpu_decode.py --variants-only --variants baseline,batch_invariant=1` and
`gpu_deepseek.py --skip-hf --variants batch_invariant=1`, each an A/B in one process.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams

PROMPT = "Tell me about Richard Feynman."   # Thinking Machines' prompt


def make_llm(args, batch_invariant: bool) -> LLM:
    fields = dict(device=args.device, dtype=args.dtype, max_num_seqs=64,
                  batch_invariant=batch_invariant)
    if args.model:
        fields["model"] = args.model
    if args.device.startswith("cuda"):   # two engines share the GPU
        fields["kv_cache_memory_bytes"] = 2 << 30
    return LLM(config=EngineConfig().with_fields(**fields))


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


def distinct_outputs(llm: LLM, args) -> dict:
    """Distinct completions of PROMPT over `args.completions` copies under varying load."""
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                               add_generation_prompt=True, tokenize=False)
    target = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=5)
    rng, vocab = random.Random(0), len(llm.tokenizer)
    tokens, full = set(), set()
    done = 0
    while done < args.completions:
        copies = min(args.per_round, args.completions - done)
        load = [(random_prompt(rng, rng.randint(4, 300), vocab),
                 SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30),
                                max_tokens=rng.randint(1, 64), ignore_eos=True))
                for _ in range(rng.randint(0, args.max_load))]
        requests = [(prompt, target)] * copies + load
        rng.shuffle(requests)
        outputs = llm.generate([p for p, _ in requests], [s for _, s in requests])
        for (_, params), out in zip(requests, outputs):
            if params is target:
                choice = out.outputs[0]
                tokens.add(tuple(choice.token_ids))
                full.add((tuple(choice.token_ids),
                          tuple((t.logprob, tuple(t.top)) for t in choice.logprobs)))
        done += copies
    return {"completions": done, "distinct_token_sequences": len(tokens),
            "distinct_with_logprobs": len(full)}


def decode_rate(llm: LLM, batch: int, args, rng: random.Random) -> float:
    """Decode tokens/s of `batch` fresh prompts (prefill time subtracted)."""
    vocab = len(llm.tokenizer)

    def timed(new_tokens: int) -> float:
        prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                             ignore_eos=True))
        return time.perf_counter() - start

    return batch * args.decode_tokens / (timed(1 + args.decode_tokens) - timed(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bf16 on CUDA")
    parser.add_argument("--completions", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=25)
    parser.add_argument("--max-load", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    engines = {"off": make_llm(args, False), "on": make_llm(args, True)}
    machine = platform.processor() or platform.machine()
    if args.device.startswith("cuda"):
        import torch

        machine = torch.cuda.get_device_name()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
              "args": vars(args)}
    for mode, llm in engines.items():
        result[f"distinct_{mode}"] = distinct_outputs(llm, args)
        print(f"mode {mode}: {result[f'distinct_{mode}']}", flush=True)
    rng = random.Random(1)
    rates = {mode: {} for mode in engines}
    for _ in range(args.repeats):
        for batch in map(int, args.batches.split(",")):
            for mode, llm in engines.items():
                rate = decode_rate(llm, batch, args, rng)
                rates[mode][batch] = max(rates[mode].get(batch, 0.0), rate)
    result["decode_tok_s"] = rates
    print("batch  off tok/s  on tok/s  on/off")
    for batch in rates["off"]:
        off, on = rates["off"][batch], rates["on"][batch]
        print(f"{batch:5d}  {off:9.1f}  {on:8.1f}  {on / off:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
