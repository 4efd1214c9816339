"""Start-up profile of plain and verify steps: seconds per step at a grid of batch-token counts,
the starting values of the varlen admission's `StepRateTable` (engine/spec/step_rate.py), which
the engine's own step times then replace.

Each point runs the runner's own step path (input building, forward, LM head over every scored
position, greedy argmax) on synthetic decode rows against a context of `context_len` tokens: a
plain point of B tokens is B decode rows without drafts; a verify point of B tokens is one row
with B - 1 drafts while B <= 1 + num_speculative_tokens, then B - 1 decode rows with one draft
(the batch a first admitted draft makes) up to max_num_seqs rows, then max_num_seqs rows with the
drafts spread evenly. The fastest of 5 runs per point (taken round the grid), then the least
non-decreasing fit over the grid (a bigger batch is not faster: what says otherwise is timing
noise). It runs before any request is admitted, so the KV blocks it writes hold nothing yet;
nothing it does enters the prefix cache or the KV store (no block hashes are made).
"""

from __future__ import annotations

import time

import torch

from deepinfer.engine.input_batch import CachedRequestState, build_step_inputs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.step_rate import StepRateTable, nondecreasing


def token_grid(max_tokens: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to and including max_tokens."""
    grid, value = {1}, 1
    while value < max_tokens:
        grid.update((value, min(value + value // 2, max_tokens), min(2 * value, max_tokens)))
        value *= 2
    return sorted(b for b in grid if b <= max_tokens)


@torch.inference_mode()
def time_verify_step(runner, num_rows: int, num_tokens: int, context_len: int,
                     repeats: int = 2) -> float:
    """Fastest of `repeats` verify steps of `num_tokens` tokens over `num_rows` rows (seconds;
    num_rows == num_tokens: a plain decode step, no drafts).

    Args:
        runner: a ModelRunner (engine/model_runner.py).
        num_rows: decode rows, 1 <= num_rows <= num_tokens.
        num_tokens: tokens of the step (each row 1 + its drafts).
        context_len: tokens already in each row's KV cache.
    """
    per_row = [num_tokens // num_rows + (r < num_tokens % num_rows) for r in range(num_rows)]
    num_blocks = -(-(context_len + max(per_row)) // runner.block_size)
    num_blocks = min(num_blocks, runner.kv_caches[0].shape[runner.kv_block_dim])
    params = SamplingParams(temperature=0.0)
    states = [CachedRequestState(f"profile-{r}", [0] * (context_len + 1), context_len + 1,
                                 list(range(num_blocks)), context_len, params, 0)
              for r in range(num_rows)]
    drafts = {s.request_id: [0] * (n - 1) for s, n in zip(states, per_row) if n > 1} or None
    best = float("inf")
    for _ in range(repeats):
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        inputs = build_step_inputs(states, per_row, runner.block_size, runner.device,
                                   draft_token_ids=drafts)
        hidden, graph_outputs = runner._forward(inputs)
        runner._logits(inputs, hidden, graph_outputs).argmax(dim=-1).tolist()
        best = min(best, time.perf_counter() - start)
    return best


def verify_rows(num_tokens: int, *, max_num_seqs: int, num_speculative_tokens: int) -> int:
    """Rows of the profile's verify point of `num_tokens` tokens (module docstring)."""
    if num_tokens <= 1 + num_speculative_tokens:
        return 1
    return max(1, min(max_num_seqs, num_tokens - 1))


def profile_step_rate(runner, *, max_num_seqs: int, num_speculative_tokens: int,
                      max_num_batched_tokens: int, context_len: int = 64,
                      window: int = 8, repeats: int = 5) -> StepRateTable:
    """The step-rate table from 1 to the largest verify batch (every running request with all
    its drafts, within the token budget): verify points over that grid, plain points up to
    max_num_seqs tokens; `window` recent step times per point then re-measure it."""
    max_tokens = min(max_num_seqs * (1 + num_speculative_tokens), max_num_batched_tokens)
    grid = token_grid(max_tokens)
    plain_grid = [b for b in grid if b <= max_num_seqs]
    time_verify_step(runner, 1, max_tokens, context_len, repeats=1)   # warm-up, not kept
    # (rows, tokens) per point; the repeats go round the whole grid, so that a burst of load
    # from another process spoils one run of many points, not every run of one point
    points = [(min(verify_rows(b, max_num_seqs=max_num_seqs,
                               num_speculative_tokens=num_speculative_tokens), b - 1) or 1, b)
              for b in grid] + [(b, b) for b in plain_grid]
    fastest = [float("inf")] * len(points)
    for _ in range(repeats):
        for index, (rows, num_tokens) in enumerate(points):
            fastest[index] = min(fastest[index], time_verify_step(runner, rows, num_tokens,
                                                                  context_len, repeats=1))
    verify, plain = fastest[:len(grid)], fastest[len(grid):]
    return StepRateTable(dict(zip(grid, nondecreasing(verify))),
                         dict(zip(plain_grid, nondecreasing(plain))), window)
