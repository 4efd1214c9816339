"""Host cost of the speculative decoding loop per step (issue 30): what a verify step adds on the
host, where it is on the critical path (a verify step blocks; on the GPU a plain step overlaps
the host).

Model: a 1-layer Llama (hidden 64, vocab 256, float32, CPU) whose compute is negligible, with
weights that make greedy decoding walk a fixed cycle through the vocabulary (attention and MLP
outputs zero, the LM head the embeddings permuted), and prompts that hold 230 tokens of that
cycle then its first 3 again: the n-gram drafter's drafts are then accepted in full (5 of 5),
as on a grounded prompt, for ~150 tokens. `--shape smollm2 --device cuda --dtype bfloat16`:
the same weights trick at SmolLM2-135M's shape (30 layers, hidden 576, vocab 49,152) on the
GPU, where the step loop runs as served (CUDA graphs, async scheduling where the engine uses
it): the host and device split of a plain and a verify step at grounded acceptance. Engines: speculation off, n-gram fixed (k=5), n-gram varlen; batch 1
and 16; 150 new tokens, best of `--repeats` runs.

Reports per (engine, batch): step ms (wall / steps), tokens per step, and the host ms per step
in the speculative decoder (`SpecDecoder.may_draft` + `propose` + `observe`: drafter,
admission, pricing), the scheduler and the runner's sampling and commit. On the GPU the
speculative decoder's time is paid in full by every verify step.

    python benchmarks/bench_spec_host.py [--repeats 3] [--json out.json]
        [--shape tiny|smollm2] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

GAMMA, NEW_TOKENS, PROMPT_CYCLE = 5, 150, 230
SHAPES = {   # LlamaConfig fields
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
}


def _cycle(vocab: int, seed: int = 0) -> tuple[torch.Tensor, dict[int, int]]:
    """(permutation for the LM head, next token of each token): one cycle over the vocab."""
    order = list(range(vocab))
    random.Random(seed).shuffle(order)
    perm = torch.empty(vocab, dtype=torch.long)
    for i in range(vocab):
        perm[order[(i + 1) % vocab]] = order[i]   # logits of y peak where perm[y] == x
    return perm, {int(perm[y]): y for y in range(vocab)}


def _walk(start: int, length: int, following: dict[int, int]) -> list[int]:
    tokens = [start]
    while len(tokens) < length:
        tokens.append(following[tokens[-1]])
    return tokens


def build_engine(model_dir: Path, perm: torch.Tensor, speculation: str | None,
                 device: str = "cpu", dtype: str = "float32"):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.engine.models.llama import LlamaForCausalLM

    config = LlamaConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    weights = HFLlama(config).state_dict()
    with torch.no_grad():
        for name, tensor in weights.items():
            if "o_proj" in name or "down_proj" in name:
                tensor.zero_()
        weights["model.embed_tokens.weight"].mul_(8.0)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"][perm].clone()
    model = LlamaForCausalLM(config, getattr(torch, dtype)).eval()
    model.load_weights(weights.items())
    model.to(device)
    cache = {"enable_prefix_caching": False}
    if device == "cuda":
        cache["kv_cache_memory_bytes"] = 2 << 30
    fields = dict(model={"model": str(model_dir), "device": device, "dtype": dtype},
                  cache=cache,
                  scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 2048},
                  kv_transfer={"kv_store": "none"})
    if speculation is not None:
        fields["speculative"] = {"speculative_method": "ngram", "num_speculative_tokens": GAMMA,
                                 "spec_varlen": speculation == "varlen"}
    return EngineCore(EngineConfig().replace(**fields), model=model)


# host time of the speculative decoder, the scheduler and the runner's sampling + commit
STAGES = (("spec", "may_draft"), ("spec", "propose"), ("spec", "observe"),
          ("scheduler", "schedule"), ("scheduler", "update_from_output"),
          ("executor.runner", "_sample_step"), ("executor.runner", "_forward"),
          ("executor.runner", "execute"), ("executor.runner", "execute_async"),
          ("output_processor", "process"))
SPEC_STAGES = ("may_draft", "propose", "observe")


def run(core, prompts: list[list[int]]) -> dict:
    """Decode every prompt at once (greedy, NEW_TOKENS each); time the steps after each has its
    first token."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in prompts:
        core.add_request(core.make_request(prompt, params))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in core.step())
    from gpu_decode import StageTimer

    tokens = steps = 0
    with StageTimer(core, STAGES) as timer:
        start = time.perf_counter()
        while core.has_unfinished_requests():
            tokens += sum(len(out.new_token_ids) for out in core.step())
            steps += 1
        seconds = time.perf_counter() - start
    spec = sum(v for k, v in timer.seconds.items() if k in SPEC_STAGES)
    return {"step_ms": 1e3 * seconds / steps, "tokens_per_step": tokens / steps,
            "tok_s": tokens / seconds, "spec_host_ms_per_step": 1e3 * spec / steps,
            **{f"{k}_ms_per_step": 1e3 * v / steps for k, v in sorted(timer.seconds.items())}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig   # before gpu_decode puts the repository root on
    import transformers.activations  # noqa: F401  sys.path (its `kernels` is not HF's)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_decode import write_model_dir

    torch.set_num_threads(1)
    shape = SHAPES[args.shape]
    model_dir = write_model_dir(Path(tempfile.mkdtemp()), LlamaConfig(
        **shape, tie_word_embeddings=False, max_position_embeddings=4096))
    perm, following = _cycle(shape["vocab_size"])
    results = {}
    for speculation in (None, "fixed", "varlen"):
        core = build_engine(model_dir, perm, speculation, args.device, args.dtype)
        for batch in (1, 16):
            prompts = [_walk(3 + 7 * b, PROMPT_CYCLE, following) + _walk(3 + 7 * b, 3, following)
                       for b in range(batch)]
            run(core, prompts[:1])   # warm-up
            best = min((run(core, prompts) for _ in range(args.repeats)),
                       key=lambda r: r["step_ms"])
            label = f"{speculation or 'off'} b={batch}"
            results[label] = {k: round(v, 4) for k, v in best.items()}
            print(f"{label}: {best['step_ms']:.3f} ms/step, {best['tokens_per_step']:.2f} "
                  f"tok/step, speculative decoder {best['spec_host_ms_per_step']:.3f} ms/step",
                  flush=True)
            print("   ", {k.replace("_ms_per_step", ""): round(v, 3) for k, v in best.items()
                          if k.endswith("_ms_per_step")}, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"shape": args.shape, "device": args.device, "dtype": args.dtype, **results},
            indent=1))
    return results


if __name__ == "__main__":
    main()
