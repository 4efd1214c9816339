"""Start-up profile of plain and verify steps: the starting values of the varlen admission's
`StepRateTable` (engine/spec/step_rate.py), which the engine's own step times then replace.

Each point runs the runner's own blocking step path (input building, forward, LM head over every
scored position, the sampler over every position's sampling state and the commit of the drafts)
on synthetic decode rows against a context of `context_len` tokens. plain(B) is B decode rows
without drafts, for B on a grid up to max_num_seqs. extra(D) is a verify step of D drafts spread
over the fewest rows that hold them (ceil(D / gamma) rows: one row for D <= gamma, the batch that
verifies every draft of each row above) minus the plain step of those rows, for D on a grid up to
max_num_seqs x gamma (within the token budget); the full batch's extra, D drafts spread over
max_num_seqs rows minus its plain step, on the powers of two of that grid (a draft costs more
at a large batch: StepRateTable's batch buckets start from these). The fastest of `repeats`
runs per point (taken round the grid, so that a burst of load from another process spoils one
run of many points, not every run of one point), then the least non-decreasing fit of each curve (a bigger batch is not
faster: what says otherwise is timing noise).

What the profile cannot see, the engine's steps then measure: on the GPU plain steps overlap the
host (async scheduling) while verify steps block, so the real extra is larger than the profile's
and the first verify steps raise it. The profile runs before any request is admitted, so the KV
blocks it writes hold nothing yet; nothing it does enters the prefix cache or the KV store (no
block hashes are made).
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
def time_step(runner, num_rows: int, num_drafts: int, context_len: int) -> float:
    """Seconds of one blocking step of `num_rows` decode rows verifying `num_drafts` drafts
    spread evenly over them (0: a plain decode step), sampled and committed greedily.

    Args:
        runner: a ModelRunner (engine/model_runner.py).
        num_rows: decode rows, >= 1.
        num_drafts: draft tokens in the step, >= 0.
        context_len: tokens already in each row's KV cache.
    """
    per_row = [1 + num_drafts // num_rows + (r < num_drafts % num_rows) for r in range(num_rows)]
    num_blocks = -(-(context_len + max(per_row)) // runner.block_size)
    num_blocks = min(num_blocks, runner.kv_caches[0].shape[runner.kv_block_dim])
    params = SamplingParams(temperature=0.0)
    states = [CachedRequestState(f"profile-{r}", [0] * (context_len + 1), context_len + 1,
                                 list(range(num_blocks)), context_len, params, 0)
              for r in range(num_rows)]
    drafts = {s.request_id: [0] * (n - 1) for s, n in zip(states, per_row) if n > 1} or None
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    start = time.perf_counter()
    inputs = build_step_inputs(states, per_row, runner.block_size, runner.device,
                               draft_token_ids=drafts)
    hidden, graph_outputs = runner._forward(inputs)
    runner._sample_step(inputs, hidden, graph_outputs)
    return time.perf_counter() - start


def profile_step_rate(runner, *, max_num_seqs: int, num_speculative_tokens: int,
                      max_num_batched_tokens: int, context_len: int = 64,
                      window: int = 8, repeats: int = 5) -> StepRateTable:
    """The step-rate table: plain points up to max_num_seqs rows, extra points up to every
    running request with all its drafts (within the token budget); `window` recent step times
    per point then re-measure it."""
    gamma = num_speculative_tokens
    max_drafts = min(max_num_seqs * gamma, max_num_batched_tokens - max_num_seqs)
    plain_grid = token_grid(max_num_seqs)
    draft_grid = token_grid(max(max_drafts, 1))
    # the full batch's extras, on a sparser grid (powers of two and the end): a draft at batch
    # 16 costs what it does not at batch 1 (SmolLM2 on the 2-core CPU box: the first 12 ms
    # against 5 ms), so the batch buckets between start from values of their own size
    batch_grid = sorted({d for d in draft_grid if d & (d - 1) == 0} | {draft_grid[-1]})
    time_step(runner, max_num_seqs, max(max_drafts, 0), context_len)   # warm-up, not kept
    # (rows, drafts) per point: the plain points, then each extra point's verify step
    points = [(rows, 0) for rows in plain_grid] + [(-(-d // gamma), d) for d in draft_grid]
    for rows in {-(-d // gamma) for d in draft_grid} - set(plain_grid):   # their plain steps
        points.append((rows, 0))
    few_rows = len(points)
    if max_num_seqs > 1 and max_drafts > 0:
        points += [(max_num_seqs, d) for d in batch_grid]
    fastest = [float("inf")] * len(points)
    for _ in range(repeats):
        for index, (rows, num_drafts) in enumerate(points):
            fastest[index] = min(fastest[index], time_step(runner, rows, num_drafts,
                                                           context_len))
    plain_of = {rows: seconds for (rows, drafts), seconds in zip(points, fastest) if not drafts}
    plain = nondecreasing([plain_of[rows] for rows in plain_grid])
    extra = nondecreasing([max(seconds - plain_of[rows], 0.0)
                           for (rows, drafts), seconds in zip(points[:few_rows], fastest)
                           if drafts])
    batch_extra = {}
    if len(points) > few_rows:
        batch_extra[max_num_seqs] = dict(zip(batch_grid, nondecreasing(
            [max(seconds - plain_of[max_num_seqs], 0.0) for seconds in fastest[few_rows:]])))
    return StepRateTable(dict(zip(plain_grid, plain)), dict(zip(draft_grid, extra)), window,
                         batch_extra_seconds=batch_extra)
