"""Sampler: greedy, seeded determinism across batches, filters, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from deepinfer.engine import sampler as sampler_module
from deepinfer.engine.sampler import (
    Sampler,
    apply_penalties,
    build_sampling_metadata,
    filter_candidates,
    random_bits,
    request_key,
)
from deepinfer.engine.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


@dataclass
class Row:
    sampling_params: SamplingParams
    seed: int = 0
    token_ids: Sequence[int] = (1, 2, 3)
    num_prompt_tokens: int = 3


def sample(logits: torch.Tensor, rows: list[Row], eos=frozenset()):
    metadata = build_sampling_metadata(rows, "cpu", eos_token_ids=eos)
    return Sampler()(logits, metadata)


def splitmix64_reference(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    logits[2, 17] = logits[2, 42] = 50.0     # tie: 17 wins
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(6)]
    metadata = build_sampling_metadata(rows, "cpu", eos_token_ids=())
    assert metadata.argmax_only and metadata.temperature is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[2] == 17
    assert out.logprobs is None


def test_random_bits_match_python_splitmix64():
    keys = [request_key(0, 0), request_key(-1, 5), request_key(2**64 - 1, 123456)]
    vocab = 37
    counters = torch.arange(1, vocab + 1, dtype=torch.int64) * (GOLDEN - 2**64)
    bits = random_bits(keys, counters).tolist()
    for row, key in zip(bits, keys):
        expected = [splitmix64_reference(key + GOLDEN * (v + 1)) for v in range(vocab)]
        assert [b & MASK64 for b in row] == expected
    assert request_key(7, 3) == splitmix64_reference(splitmix64_reference(7 + GOLDEN)
                                                     + GOLDEN * 4)


def test_seeded_row_is_the_same_alone_in_a_batch_and_in_any_order():
    torch.manual_seed(1)
    vocab = 500
    for trial in range(20):
        target_logits = torch.randn(1, vocab) * 2
        # candidate path (top-k fits), top-p only (candidates or whole row), whole row
        params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50),
                  SamplingParams(temperature=0.9, top_p=0.95),
                  SamplingParams(temperature=1.1, min_p=0.02)][trial % 3]
        target = Row(params, seed=1000 + trial, token_ids=list(range(10 + trial)),
                     num_prompt_tokens=4)
        alone = sample(target_logits, [target]).sampled_token_ids[0]
        others = [Row(SamplingParams(temperature=t, top_k=k, min_p=m), seed=s,
                      token_ids=list(range(3 + s % 7)), num_prompt_tokens=2)
                  for t, k, m, s in [(1.0, -1, 0.0, 1), (0.0, -1, 0.0, 2), (0.5, 3, 0.0, 3),
                                     (1.3, -1, 0.1, 4), (0.7, 10, 0.0, 5), (1.0, -1, 0.0, 6),
                                     (0.0, -1, 0.0, 7), (2.0, 300, 0.05, 8)]]
        other_logits = torch.randn(8, vocab) * 3
        batch = sample(torch.cat([other_logits[:3], target_logits, other_logits[3:]]),
                       others[:3] + [target] + others[3:]).sampled_token_ids
        order = [5, 0, 7, 3, 1, 6, 2, 4]
        shuffled = sample(torch.cat([target_logits, other_logits[order]]),
                          [target] + [others[i] for i in order]).sampled_token_ids
        assert batch[3] == alone and shuffled[0] == alone
        unshuffled = [None] * 8
        for pos, i in enumerate(order):
            unshuffled[i] = shuffled[pos + 1]
        assert batch[:3] + batch[4:] == unshuffled


def test_noise_chunking_does_not_change_tokens(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(12, 64)
    rows = [Row(SamplingParams(temperature=1.0), seed=s) for s in range(12)]
    whole = sample(logits, rows).sampled_token_ids
    monkeypatch.setattr(sampler_module, "_NOISE_CHUNK_ELEMENTS", 64 * 5)  # chunks of 5 rows
    assert sample(logits, rows).sampled_token_ids == whole


def test_different_seeds_and_positions_give_different_tokens():
    vocab = 1000
    flat = torch.zeros(64, vocab)
    by_seed = sample(flat, [Row(SamplingParams(temperature=1.0), seed=s) for s in range(64)])
    by_position = sample(flat, [Row(SamplingParams(temperature=1.0), seed=5,
                                    token_ids=range(p), num_prompt_tokens=0)
                                for p in range(64)])
    # 64 uniform draws from 1000 values: expected ~62 distinct, almost surely > 50.
    assert len(set(by_seed.sampled_token_ids)) > 50
    assert len(set(by_position.sampled_token_ids)) > 50
    assert by_seed.sampled_token_ids != by_position.sampled_token_ids


def test_top_k_1_equals_greedy():
    torch.manual_seed(3)
    logits = torch.randn(16, 300)
    rows = [Row(SamplingParams(temperature=1.5, top_k=1), seed=s) for s in range(16)]
    assert sample(logits, rows).sampled_token_ids == logits.argmax(dim=-1).tolist()


def draws(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    """num_draws samples of one distribution: one request at positions 0..num_draws-1."""
    rows = [Row(params, seed=11, token_ids=range(p), num_prompt_tokens=0)
            for p in range(num_draws)]
    return sample(logits_row.expand(num_draws, -1).contiguous(), rows).sampled_token_ids


def test_top_p_and_min_p_stay_inside_the_allowed_set():
    torch.manual_seed(4)
    logits = torch.randn(200) * 2
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, set()
    for token in order:                      # smallest top set whose mass reaches 0.6
        nucleus.add(token)
        mass += probs[token].item()
        if mass >= 0.6:
            break
    top_p_draws = draws(logits, SamplingParams(temperature=1.0, top_p=0.6), 2000)
    assert set(top_p_draws) <= nucleus
    assert len(set(top_p_draws)) == len(nucleus) > 3

    allowed_min_p = {t for t in range(200) if probs[t] >= 0.2 * probs.max()}
    min_p_draws = draws(logits, SamplingParams(temperature=1.0, min_p=0.2), 2000)
    assert set(min_p_draws) == allowed_min_p and len(allowed_min_p) > 3

    top_k_draws = draws(logits, SamplingParams(temperature=1.0, top_k=5), 2000)
    assert set(top_k_draws) == set(order[:5])


def reference_nucleus(logits_row: torch.Tensor, p: float) -> set[int]:
    probs = logits_row.double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    mass, kept = 0.0, set()
    for token in order:
        if mass >= p:
            break
        kept.add(token)
        mass += probs[token].item()
    return kept


def test_candidate_filter_matches_a_full_sort_reference():
    torch.manual_seed(6)
    logits = torch.randn(6, 2000) * 4                        # peaked: nuclei within 256
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.9, 1.0])
    top_k = torch.tensor([0, 0, 0, 0, 10, 3])
    values, token_ids, within = filter_candidates(logits, top_k, top_p)
    assert values.shape == (6, 256)
    assert within.tolist() == [True, True, True, False, True, True]   # row 3: sampled over V
    kept = [set(token_ids[r][values[r] > float("-inf")].tolist()) for r in range(6)]
    for row in range(3):
        assert kept[row] == reference_nucleus(logits[row], top_p[row].item())
    assert kept[3] == set(token_ids[3].tolist())            # no filter: nothing masked
    top10 = logits[4].topk(10)
    in_top10 = torch.full_like(logits[4], float("-inf")).scatter(0, top10.indices, top10.values)
    assert kept[4] == reference_nucleus(in_top10, 0.9)       # top-p renormalized after top-k
    assert kept[5] == set(logits[5].topk(3).indices.tolist())
    flat = torch.randn(2, 2000) * 0.1                        # flat: nucleus wider than 256
    _, _, within = filter_candidates(flat, None, torch.tensor([0.9, 0.05]))
    assert within.tolist() == [False, True]


def test_full_vocabulary_nucleus_matches_the_reference_alone_and_batched():
    from deepinfer.engine.sampler import _filter_full_vocabulary

    torch.manual_seed(9)
    # nuclei of ~300 tokens (inside the 2,048 top-k tier) and of ~4,000 (a full sort)
    logits = torch.cat([torch.randn(2, 8000) * 2.5, torch.randn(2, 8000) * 0.3])
    top_p = torch.tensor([0.9, 0.8, 0.9, 0.6])
    batched = _filter_full_vocabulary(logits, None, top_p)
    for row in range(4):
        kept = set((batched[row] > float("-inf")).nonzero()[:, 0].tolist())
        assert kept == reference_nucleus(logits[row], top_p[row].item())
        alone = _filter_full_vocabulary(logits[row:row + 1], None, top_p[row:row + 1])
        assert torch.equal(alone[0], batched[row])          # bitwise: no batch dependence
    sizes = [(batched[row] > float("-inf")).sum().item() for row in range(4)]
    assert 256 < min(sizes[:2]) and max(sizes[:2]) < 2048 < min(sizes[2:])


def test_top_k_larger_than_the_candidates_stays_in_the_top_k():
    torch.manual_seed(8)
    logits = torch.randn(1000) * 0.1
    picked = draws(logits, SamplingParams(temperature=1.0, top_k=400), 1000)
    top400 = set(logits.topk(400).indices.tolist())
    assert set(picked) <= top400 and len(set(picked) - set(logits.topk(256).indices.tolist())) > 100


def test_wide_nucleus_is_sampled_over_the_whole_vocabulary():
    torch.manual_seed(7)
    logits = torch.randn(1000) * 0.1
    nucleus = reference_nucleus(logits, 0.9)
    assert len(nucleus) > 500
    picked = draws(logits, SamplingParams(temperature=1.0, top_p=0.9), 1000)
    assert set(picked) <= nucleus
    candidates = set(logits.topk(256).indices.tolist())
    assert len(set(picked) - candidates) > 200


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    temperature, num_draws = 0.7, 20000
    expected = (logits.double() / temperature).softmax(-1) * num_draws
    counts = torch.bincount(torch.tensor(draws(logits, SamplingParams(temperature=temperature),
                                               num_draws)), minlength=8).double()
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    # 7 degrees of freedom: P(chi2 > 29.9) ~ 1e-4. The draws are fixed by the seed anyway.
    assert chi_square < 29.9
    # and the draws are not a copy of the expectation (they are random): chi2 > 0.5.
    assert chi_square > 0.5


def test_penalties_follow_the_formulas_exactly():
    logits = torch.tensor([[2.0, -1.0, 4.0, 0.5, -3.0, 1.5]] * 3)
    rows = [Row(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                               presence_penalty=0.25),
                token_ids=[0, 1, 2, 2, 2, 4], num_prompt_tokens=2),   # prompt {0,1}; out 2x3, 4
            Row(SamplingParams(temperature=0.0), token_ids=[0, 5], num_prompt_tokens=1),
            Row(SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0),
                token_ids=[5, 1], num_prompt_tokens=2)]                # no output yet
    metadata = build_sampling_metadata(rows, "cpu", eos_token_ids=())
    penalized = apply_penalties(logits, metadata)
    # token 0: prompt, 2/2 = 1; token 1: prompt, -1*2 = -2; token 2: output x3: 4/2 - 0.5*3
    # - 0.25 = 0.25; token 3: unseen; token 4: output x1: -3*2 - 0.5 - 0.25; token 5: unseen.
    assert penalized[0].tolist() == [1.0, -2.0, 0.25, 0.5, -6.75, 1.5]
    assert penalized[1].tolist() == logits[1].tolist()        # no penalty: untouched
    assert penalized[2].tolist() == [2.0, -2.0, 4.0, 0.5, -3.0, 0.75]   # prompt only
    # the greedy pick follows the penalized logits: token 2 (4.0) loses to token 5 (1.5)
    assert sample(logits, rows).sampled_token_ids == [5, 2, 2]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    below = Row(params, token_ids=[0, 3], num_prompt_tokens=1)         # 1 output token < 2
    reached = Row(params, token_ids=[0, 3, 3], num_prompt_tokens=1)    # 2 output tokens
    assert sample(logits, [below], eos={1}).sampled_token_ids == [3]
    assert sample(logits, [reached], eos={1}).sampled_token_ids == [1]
    ignore = Row(params.clone(ignore_eos=True), token_ids=[0, 3], num_prompt_tokens=1)
    assert sample(logits, [ignore], eos={1}).sampled_token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top():
    torch.manual_seed(5)
    logits = torch.randn(3, 50) * 3
    rows = [Row(SamplingParams(temperature=0.8, logprobs=5), seed=1),
            Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(temperature=0.0, logprobs=0))]
    out = sample(logits, rows)
    reference = logits.log_softmax(-1)
    for row, (token_id, lp) in enumerate(zip(out.sampled_token_ids, out.logprobs)):
        assert lp.token_id == token_id
        assert math.isclose(lp.logprob, reference[row, token_id].item(), abs_tol=1e-6)
        assert lp.rank == int((reference[row] > reference[row, token_id]).sum()) + 1
    top = out.logprobs[0].top
    expected = reference[0].topk(5)
    assert [t for t, _ in top] == expected.indices.tolist()
    assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert out.logprobs[1].top == [] and out.logprobs[2].top == []
    assert out.logprobs[1].rank == 1 and out.logprobs[2].rank == 1


def test_negative_and_large_seeds_are_accepted():
    logits = torch.zeros(2, 10)
    rows = [Row(SamplingParams(temperature=1.0), seed=-(2**63)),
            Row(SamplingParams(temperature=1.0), seed=2**64 - 1)]
    out = sample(logits, rows).sampled_token_ids
    assert out == sample(logits, rows).sampled_token_ids and all(0 <= t < 10 for t in out)


@pytest.mark.parametrize("chunks", [4, 8])
def test_two_pass_argmax_is_argmax_with_first_index_on_ties_and_nan(chunks):
    """The CUDA greedy path's two passes (chunk maxima, then the best chunk) against
    torch.argmax: random rows, ties across and inside chunks, a NaN row."""
    from deepinfer.engine.sampler import two_pass_argmax

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 64, generator=gen)
    logits[1, [9, 40]] = 50.0           # tie across chunks: 9 wins
    logits[2, [17, 18]] = 50.0          # tie inside a chunk: 17 wins
    logits[3] = 1.0                     # all equal: 0
    logits[4, [5, 33]] = float("nan")   # NaN is the maximum, first NaN wins
    logits[5, 63] = 50.0                # last column
    expected = logits.argmax(dim=-1)
    assert expected.tolist()[1:] == [9, 17, 0, 5, 63]
    assert torch.equal(two_pass_argmax(logits, chunks), expected)
    assert torch.equal(sampler_module.greedy_argmax(logits), expected)   # CPU: one pass


def test_two_pass_argmax_of_bf16_logits_is_the_float32_argmax():
    """The CUDA graph takes the greedy ids from the LM head's bf16 output (no float32 copy):
    the conversion is exact, so the argmax is the same; many ties, as bf16 rounding makes."""
    from deepinfer.engine.sampler import two_pass_argmax

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(64, 1024, generator=gen) * 3).to(torch.bfloat16)
    logits[:, 500] = logits.max(dim=1).values   # ties with each row's own maximum
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(two_pass_argmax(logits, 128), expected)
    assert torch.equal(sampler_module.greedy_argmax(logits), expected)


def test_samples_by_argmax_agrees_with_the_metadata_it_stands_for():
    """`samples_by_argmax` (no metadata built) answers as `build_sampling_metadata(...)
    .argmax_only` over every mix of the settings that decide it: temperature, each penalty,
    logprobs, min_tokens reached or pending, with and without stop ids and ignore_eos."""
    import itertools

    from deepinfer.engine.sampling_metadata import samples_by_argmax

    settings = [{}, {"temperature": 0.7}, {"repetition_penalty": 1.2},
                {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"logprobs": 0},
                {"min_tokens": 1}, {"min_tokens": 9}, {"min_tokens": 9, "ignore_eos": True},
                {"min_tokens": 9, "ignore_eos": True, "stop_token_ids": [4]}]
    rows = [Row(SamplingParams(**{"temperature": 0.0, **kw}),
                token_ids=(1, 2, 3, 4, 5)) for kw in settings]
    for count in (1, 2):
        for batch in itertools.combinations(rows, count):
            for eos in (frozenset(), frozenset({2})):
                expected = build_sampling_metadata(batch, "cpu", eos_token_ids=eos).argmax_only
                assert samples_by_argmax(batch, eos_token_ids=eos) == expected
    assert samples_by_argmax(rows[:1], eos_token_ids={2})
    assert not samples_by_argmax(rows[1:2], eos_token_ids={2})
