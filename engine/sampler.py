"""`Sampler`: [B, V] logits -> one token id per row, plus logprobs when asked.

Order of work (vLLM v1's, with HF's filter order):
  1. raw logprobs = log_softmax(logits) as the model produced them (vLLM's default
     `logprobs_mode="raw_logprobs"`): what a client gets is the model's distribution, not the
     one after temperature, penalties or filters.
  2. masked tokens (EOS / stop token ids below min_tokens, and tokens a row's structured-output
     grammar forbids: its XGrammar bitmask) -> -inf. So greedy, penalties, top-k / top-p /
     min-p all choose among allowed tokens only; logprobs stay the model's raw ones (step 1).
  3. penalties, on every row that sets one (greedy rows too): repetition (CTRL, Keskar et al.
     2019: over prompt + output tokens, positive logits divided by the penalty, negative ones
     multiplied), then OpenAI's frequency (x count in the output) and presence (x [count > 0]).
  4. greedy rows: argmax (ties go to the lowest token id).
  5. random rows: / temperature -> top-k -> top-p (the smallest set of most likely tokens whose
     mass reaches p, in the distribution renormalized after top-k) -> min-p (drop
     p_i < min_p * max p) -> exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. per
     token, which draws token i with probability probs_i (the Gumbel-max trick in exponential
     form; vLLM `random_sample`).

Cost: a row with top-k (k <= _CANDIDATES) or top-p is filtered and sampled among its top
_CANDIDATES logits (one `topk` over V instead of a sort and V random numbers); only a larger k or
a nucleus wider than that (a flat distribution) takes the whole row (a sort for top-p). Rows
without top-k / top-p draw V numbers. Ties: logits equal to the last kept one (the k-th, or the
nucleus's last) are kept too, as far as the candidates reach.

Determinism: E for row r comes from a counter-based generator (Salmon et al. 2011, "Parallel
random numbers: as easy as 1, 2, 3"): the 64-bit value for token v is
`splitmix64_mix(key_r + GOLDEN * (v + 1))`, with `key_r = request_key(seed_r, position_r)`
(splitmix64: Steele, Lea & Flood 2014; Vigna's splitmix64.c). It depends on nothing but
(seed, position, v), so a request draws the same tokens whatever else is in the batch, in any
row order, on CPU or GPU (given the same logits), and whether it is sampled among candidates or
over the whole vocabulary (token v gets the same E either way). Only random rows pay for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.outputs import TokenLogprobs
from deepinfer.engine.sampling_metadata import SamplingMetadata, build_sampling_metadata

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "build_sampling_metadata",
           "apply_penalties", "filter_candidates", "request_key", "random_bits",
           "exponential_noise", "greedy_argmax"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_NOISE_CHUNK_ELEMENTS = 1 << 16  # on CPU, rows * vocab per noise chunk: temporaries stay in L2
_CANDIDATES = 256                # top logits a top-k / top-p row is sampled among
_NUCLEUS_WIDTH = 2048            # top logits searched for a wider nucleus before a full sort
_TWO_PASS_MAX_ROWS = 64          # greedy_argmax: up to this many CUDA rows take two passes


def _signed64(value: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no general uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64(z: int) -> int:
    """splitmix64's output function on a Python int (uint64 in, uint64 out)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def request_key(seed: int, position: int) -> int:
    """The uint64 stream key of one request at one token position.

    The seed is hashed first, then offset by the position along splitmix64's Weyl sequence and
    hashed again, so neighbouring seeds and positions give unrelated keys.
    """
    return _mix64(_mix64(seed + _GOLDEN) + _GOLDEN * (position + 1))


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    """`z >>> bits` on int64 bit patterns (torch's `>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def random_bits(keys: list[int], counters: torch.Tensor) -> torch.Tensor:
    """splitmix64 outputs for every (key, counter) pair.

    Args:
        keys: R uint64 keys (Python ints).
        counters: int64 `GOLDEN * (v + 1)` bit patterns (see `Sampler._counter_tensor`): [V]
            for every token of the vocabulary, or [R, C] for C chosen tokens per row.
    Returns:
        [R, V] or [R, C] int64 holding the uint64 bit patterns `mix64(key_r + GOLDEN * (v + 1))`.
    Relies on int64 multiply and add wrapping modulo 2^64 (two's complement), as torch does on
    CPU and CUDA; tests check it bit for bit against the Python reference.
    """
    key = torch.tensor([_signed64(k) for k in keys], dtype=torch.int64, device=counters.device)
    z = key[:, None] + counters                                # [R, V] or [R, C]
    z ^= _shift_right_logical(z, 30)
    z *= _signed64(_MIX1)
    z ^= _shift_right_logical(z, 27)
    z *= _signed64(_MIX2)
    z ^= _shift_right_logical(z, 31)
    return z


def exponential_noise(keys: list[int], counters: torch.Tensor) -> torch.Tensor:
    """Exp(1) samples, float32 of `random_bits`'s shape, from the top 23 bits of each value.

    u = (2k + 1) / 2^24 for k in [0, 2^23) is exact in float32 and lies strictly inside (0, 1),
    so E = -log(u) is finite and positive.
    """
    top23 = _shift_right_logical(random_bits(keys, counters), 41)
    uniform = top23.to(torch.float32).mul_(2.0 ** -23).add_(2.0 ** -24)   # (2k + 1) / 2^24
    return uniform.log_().neg_()


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: `logits.argmax(dim=-1)`, the first maximal index of each row.

    On CUDA, up to _TWO_PASS_MAX_ROWS rows of a vocabulary that splits evenly are reduced in
    two passes (the maximum of each of C chunks, then the first chunk holding the row's
    maximum): torch's one-pass argmax reduces a row in one thread block, ~27 us for 1 to 64 rows
    of 128,256 logits on an H200, against 11-13 us in two passes of 256 chunks at 1-8 rows and
    19 us of 128 chunks at 64 rows (bf16); at 256 rows one pass is faster (46 against 53 us;
    benchmarks/RESULTS.md run 14). Same result: both passes keep the first maximal index (NaN
    counts as the maximum, as in torch.argmax).
    """
    rows, vocab = logits.shape
    widths = (256, 128, 64) if rows < 32 else (128, 64)
    chunks = next((c for c in widths if vocab % c == 0), 0)
    if not (logits.is_cuda and rows <= _TWO_PASS_MAX_ROWS and chunks):
        return logits.argmax(dim=-1)
    return two_pass_argmax(logits, chunks)


def two_pass_argmax(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    """`greedy_argmax`'s two passes: logits [B, V] with V % chunks == 0 -> [B] int64."""
    rows, vocab = logits.shape
    width = vocab // chunks
    values, index = logits.reshape(rows, chunks, width).max(dim=-1)   # [B, C] each
    chunk = values.argmax(dim=-1, keepdim=True)                       # [B, 1] first best chunk
    return (chunk * width + index.gather(1, chunk)).squeeze(1)


def _padded_ids(rows: list[tuple[Sequence[int], ...]],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists (each row the concatenation of its segments) as [B, L] int64, each row
    padded with its own first id (0 if empty), so a scatter of per-token values writes pads
    with the same value as the real entry. Also returns [B, L] float32: 1.0 real, 0.0 pad."""
    lengths = np.fromiter((sum(len(seg) for seg in row) for row in rows), np.int64, len(rows))
    width = max(1, int(lengths.max()))
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(row)
                                                     for row in rows),
                       np.int64, int(lengths.sum()))
    real = np.arange(width) < lengths[:, None]                                # [B, L]
    first = np.zeros(len(rows), dtype=np.int64)
    if flat.size:
        starts = np.minimum(np.cumsum(lengths) - lengths, flat.size - 1)
        first = np.where(lengths > 0, flat[starts], 0)
    ids = np.repeat(first[:, None], width, axis=1)
    ids[real] = flat
    return (torch.from_numpy(ids).to(device),
            torch.from_numpy(real.astype(np.float32)).to(device))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties.

    Args:
        logits: [B, V] float32.
        metadata: with penalty tensors, prompt_token_ids and output_token_ids set.
    Returns:
        [B, V] float32, a new tensor: for tokens in prompt or output, `l / r` if l > 0 else
        `l * r`; then `- frequency * count_in_output - presence * (count_in_output > 0)`.
    Only the entries of tokens that occur are read and written (gather / scatter over [B, L]
    ids), so the cost follows the sequence lengths, not V.
    """
    logits = logits.clone()
    repetition = metadata.repetition_penalties[:, None]                       # [B, 1]
    if bool((repetition != 1.0).any()):
        seen_ids, _ = _padded_ids(list(zip(metadata.prompt_token_ids,
                                           metadata.output_token_ids)), logits.device)  # [B, L]
        values = logits.gather(1, seen_ids)
        values = torch.where(values > 0, values / repetition, values * repetition)
        logits.scatter_(1, seen_ids, values)
    frequency = metadata.frequency_penalties[:, None]
    presence = metadata.presence_penalties[:, None]
    if bool(((frequency != 0.0) | (presence != 0.0)).any()):
        output_ids, weights = _padded_ids([(o,) for o in metadata.output_token_ids],
                                          logits.device)                               # [B, Lo]
        counts = torch.zeros_like(logits).scatter_add_(1, output_ids, weights)     # [B, V]
        counts = counts.gather(1, output_ids)                                      # [B, Lo]
        values = logits.gather(1, output_ids) - frequency * counts - presence * (counts > 0)
        logits.scatter_(1, output_ids, values)
    return logits


def filter_candidates(scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k and top-p among each row's top C = min(V, _CANDIDATES) logits.

    Args:
        scaled: [R, V] float32 logits / temperature.
        top_k: [R] int64, 0 = off.  top_p: [R] float32, 1.0 = off.
    Returns:
        values: [R, C] float32, the top C logits, descending, filtered ones set to -inf;
        token_ids: [R, C] int64, their ids;
        within: [R] bool, the row filters and its whole support is among its candidates:
            k <= C, or (no top-k) the candidates hold mass >= p (a token outside has at least
            that much mass before it, so it is outside the nucleus). Other rows' values are
            not meaningful. C is a constant, so a row's result does not depend on the batch.
    """
    vocab = scaled.shape[-1]
    width = min(vocab, _CANDIDATES)
    no_rows = torch.zeros(scaled.shape[0], dtype=torch.bool, device=scaled.device)
    k_on = no_rows if top_k is None else (top_k > 0) & (top_k < vocab)     # [R]
    k_fits = k_on if top_k is None else k_on & (top_k <= width)
    p_on = no_rows if top_p is None else top_p < 1.0
    values, token_ids = scaled.topk(width, dim=-1)                       # [R, C], descending
    if bool(k_fits.any()):
        kth = values.gather(1, (torch.where(k_fits, top_k, 1) - 1)[:, None])    # [R, 1]
        values = values.masked_fill((values < kth) & k_fits[:, None], float("-inf"))
    within = k_fits
    if bool(p_on.any()):
        # p is a share of the row after top-k: all of which is among the candidates if k fits
        log_total = torch.where(k_fits[:, None], values.logsumexp(dim=-1, keepdim=True),
                                scaled.logsumexp(dim=-1, keepdim=True))   # [R, 1]
        probs = (values - log_total).exp()                               # [R, C]
        mass_before = probs.cumsum(dim=-1) - probs                       # of likelier tokens
        values = values.masked_fill((mass_before >= top_p[:, None]) & p_on[:, None],
                                    float("-inf"))
        within = within | (p_on & ~k_on & (probs.sum(dim=-1) >= top_p))
    return values, token_ids, within


def _filter_full_vocabulary(scaled: torch.Tensor, top_k: torch.Tensor | None,
                            top_p: torch.Tensor | None) -> torch.Tensor:
    """[R, V] -> [R, V]: top-k then top-p over the whole row (a sort for top-p); for rows
    `filter_candidates` cannot take (k > C, or a nucleus wider than C)."""
    vocab = scaled.shape[-1]
    if top_k is not None:
        k_on = (top_k > 0) & (top_k < vocab)
        if bool(k_on.any()):
            k = torch.where(k_on, top_k, 1)
            kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
            kth.masked_fill_(~k_on[:, None], float("-inf"))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and bool((top_p < 1.0).any()):
        smallest_kept = _nucleus_threshold(scaled, top_p)                 # [R, 1]
        smallest_kept.masked_fill_((top_p >= 1.0)[:, None], float("-inf"))
        scaled = scaled.masked_fill(scaled < smallest_kept, float("-inf"))
    return scaled


def _nucleus_threshold(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] logits, [R] p -> [R, 1]: the smallest logit inside each row's top-p nucleus.

    A row whose top `_NUCLEUS_WIDTH` logits hold mass >= p reads its nucleus from them (a top-k
    is ~6x cheaper than sorting 50k values on CPU); the other rows sort the whole row. Both
    give the same descending values, and which path a row takes depends on that row alone, so
    the result does not depend on the batch.
    """
    log_total = scaled.logsumexp(dim=-1, keepdim=True)                    # [R, 1]
    top_values = scaled.topk(min(scaled.shape[-1], _NUCLEUS_WIDTH), dim=-1).values  # [R, W]
    threshold = _last_kept(top_values, log_total, top_p)
    wide = (~((top_values - log_total).exp().sum(dim=-1) >= top_p)).nonzero()[:, 0]
    if len(wide):
        sorted_values = scaled[wide].sort(dim=-1, descending=True).values  # [N, V]
        threshold[wide] = _last_kept(sorted_values, log_total[wide], top_p[wide])
    return threshold


def _last_kept(values: torch.Tensor, log_total: torch.Tensor, top_p: torch.Tensor
               ) -> torch.Tensor:
    """[R, W] descending logits -> [R, 1]: the last value whose preceding mass is < p."""
    probs = (values - log_total).exp()
    num_kept = ((probs.cumsum(dim=-1) - probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)
    return values.gather(1, (num_kept - 1)[:, None])


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Zero probs below min_p * the row's max ([R, N] -> [R, N]). The race needs no renorm."""
    if min_p is None:
        return probs
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return probs * (probs >= threshold)


@dataclass
class SamplerOutput:
    """sampled_token_ids: B ids, one per logits row.
    logprobs: None unless some row asked; then one `TokenLogprobs` per row (raw logprobs; `top`
        holds that row's `num_logprobs` entries, empty for rows that did not ask)."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None


class Sampler:
    """Stateless apart from a cache of per-vocabulary counter tensors. See the module doc."""

    def __init__(self) -> None:
        self._counters: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Args: logits [B, V] float32 (row r = metadata row r). Returns B sampled ids."""
        token_ids, logprobs = self.sample_on_device(logits, metadata)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def sample_on_device(self, logits: torch.Tensor, metadata: SamplingMetadata
                         ) -> tuple[torch.Tensor, list[TokenLogprobs] | None]:
        """As `__call__`, but the sampled ids stay on the logits' device: [B] int64, so the
        caller need not wait for the device (async scheduling, engine/async_step.py). The
        argmax-only path never synchronizes; the random, penalty and logprob paths still do."""
        if metadata.argmax_only:                                     # the batch-1 decode path
            return greedy_argmax(logits), None
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.num_logprobs is not None else None
        logits = self._mask_tokens(logits, metadata.masked_token_ids)
        if metadata.grammar_bitmask is not None:
            logits = _apply_grammar_bitmask(logits, metadata.grammar_bitmask,
                                            metadata.grammar_rows)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        if metadata.all_greedy:
            token_ids = greedy_argmax(logits)
        else:
            token_ids = self._sample_random_rows(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, token_ids, metadata.num_logprobs,
                                        metadata.max_num_logprobs)
        return token_ids, logprobs

    @staticmethod
    def _mask_tokens(logits: torch.Tensor, masked: list[list[int] | None] | None) -> torch.Tensor:
        if masked is None:
            return logits
        vocab = logits.shape[-1]
        rows = [r for r, ids in enumerate(masked) if ids for t in ids if 0 <= t < vocab]
        cols = [t for ids in masked if ids for t in ids if 0 <= t < vocab]
        index = torch.tensor([rows, cols], dtype=torch.int64, device=logits.device)
        return logits.index_put((index[0], index[1]),
                                torch.tensor(float("-inf"), device=logits.device))

    def _sample_random_rows(self, logits: torch.Tensor,
                            metadata: SamplingMetadata) -> torch.Tensor:
        """[B] int64: argmax for greedy rows, a seeded draw for the random rows."""
        rows = metadata.random_rows
        device = logits.device
        index = None if len(rows) == logits.shape[0] else torch.tensor(rows, device=device)
        temperature, top_k, top_p, min_p = (
            t if t is None or index is None else t[index]
            for t in (metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p))
        scaled = (logits if index is None else logits[index]) / temperature[:, None]  # [R, V]
        keys = [request_key(metadata.seeds[r], metadata.positions[r]) for r in rows]
        sampled = torch.empty(len(rows), dtype=torch.int64, device=device)
        within = torch.zeros(len(rows), dtype=torch.bool, device=device)
        if top_k is not None or top_p is not None:
            values, candidate_ids, within = filter_candidates(scaled, top_k, top_p)
            picked = within.nonzero()[:, 0]                              # rows sampled here
            if len(picked):
                probs = _apply_min_p(values[picked].softmax(dim=-1), _rows(min_p, picked))
                candidate_ids = candidate_ids[picked]                    # [P, C]
                choice = self._exponential_race(probs, [keys[i] for i in picked.tolist()],
                                                self._counter_tensor(scaled.shape[-1],
                                                                     device)[candidate_ids])
                sampled[picked] = candidate_ids.gather(1, choice[:, None])[:, 0]
        rest = (~within).nonzero()[:, 0]                                 # rows over all of V
        if len(rest):
            wide = _filter_full_vocabulary(scaled[rest], _rows(top_k, rest), _rows(top_p, rest))
            probs = _apply_min_p(wide.softmax(dim=-1), _rows(min_p, rest))
            sampled[rest] = self._exponential_race(probs, [keys[i] for i in rest.tolist()])
        if index is None:
            return sampled
        token_ids = logits.argmax(dim=-1)
        token_ids[index] = sampled
        return token_ids

    def _exponential_race(self, probs: torch.Tensor, keys: list[int],
                          counters: torch.Tensor | None = None) -> torch.Tensor:
        """argmax(probs / E) per row, E from `exponential_noise`.

        Args:
            probs: [R, N] float32 (need not sum to 1).
            keys: R request keys.
            counters: [R, N] counter values of the tokens in probs' columns; None when the
                columns are the whole vocabulary (then, on CPU, rows go in L2-sized chunks).
        Returns:
            [R] int64 column index of the winner.
        """
        if counters is not None:
            return (probs / exponential_noise(keys, counters)).argmax(dim=-1)
        num_rows, vocab = probs.shape
        counters = self._counter_tensor(vocab, probs.device)
        chunk = max(1, _NOISE_CHUNK_ELEMENTS // vocab) if probs.is_cpu else num_rows
        picks = [(probs[start:start + chunk]
                  / exponential_noise(keys[start:start + chunk], counters)).argmax(dim=-1)
                 for start in range(0, num_rows, chunk)]
        return picks[0] if len(picks) == 1 else torch.cat(picks)

    def _counter_tensor(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] int64: GOLDEN * (v + 1) mod 2^64 as int64 bit patterns, cached per (V, device)."""
        cache_key = (vocab, device)
        if cache_key not in self._counters:
            steps = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)
            self._counters[cache_key] = steps * _signed64(_GOLDEN)   # wraps modulo 2^64
        return self._counters[cache_key]


def _apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                           rows: list[int] | None) -> torch.Tensor:
    """[B, V] float32 -> [B, V] float32 (a copy) with the tokens `bitmask` forbids in `rows`
    set to -inf. bitmask: [B, ceil(V / 32)] int32 (XGrammar's layout, see SamplingMetadata)."""
    from deepinfer.engine.structured.xgrammar_backend import apply_token_bitmask_

    logits = logits.clone()
    apply_token_bitmask_(logits, bitmask, list(range(logits.shape[0])) if rows is None else rows)
    return logits


def _rows(per_row: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if per_row is None else per_row[index]


def _gather_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: list[int | None], max_k: int) -> list[TokenLogprobs]:
    """Logprob, rank (1 + number of strictly likelier tokens) and top-k of each sampled token.

    Args:
        raw_logprobs: [B, V] float32, log_softmax of the unprocessed logits.
        token_ids: [B] int64 sampled ids.
        num_logprobs: per row, top entries wanted (None = 0); max_k: their maximum.
    """
    token_logprobs = raw_logprobs.gather(1, token_ids[:, None])        # [B, 1]
    ranks = (raw_logprobs > token_logprobs).sum(dim=-1) + 1             # [B]
    top_values = top_ids = [[] for _ in num_logprobs]
    if max_k > 0:
        top = raw_logprobs.topk(max_k, dim=-1)                          # [B, max_k], descending
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank,
                          top=list(zip(ids[:n or 0], values[:n or 0])))
            for token_id, logprob, rank, ids, values, n in zip(
                token_ids.tolist(), token_logprobs[:, 0].tolist(), ranks.tolist(), top_ids,
                top_values, num_logprobs)]
