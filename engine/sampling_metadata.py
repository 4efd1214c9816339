"""`SamplingMetadata`: what the sampler needs about the B requests that sample this step.

Built by the model runner once per step with `build_sampling_metadata`, read by `Sampler`. Row r
of every field is request r of the logits batch. Tensors live on the logits' device and are only
built when some row needs them: an all-greedy batch with no penalties, no min_tokens and no
logprobs costs one Python pass over B requests and no tensor at all (the batch-1 decode hot path,
where the sampler then only takes an argmax).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.engine.sampling_params import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # temperature below this samples greedily (argmax)


class SamplingState(Protocol):
    """What the builder reads of one request (the runner's `CachedRequestState` fits)."""

    sampling_params: SamplingParams
    seed: int
    token_ids: Sequence[int]      # prompt + output tokens so far
    num_prompt_tokens: int


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings for one [B, V] logits batch.

    all_greedy: every row is greedy (temperature < GREEDY_TEMPERATURE): no random numbers.
    random_rows: rows with temperature >= GREEDY_TEMPERATURE, ascending (empty if all greedy).
    temperature: [B] float32, None when no row samples randomly (greedy rows hold
        GREEDY_TEMPERATURE; the sampler never divides them).
    top_p: [B] float32 (1.0 = off), None when no random row uses top-p.
    top_k: [B] int64 (0 = off), None when no random row uses top-k.
    min_p: [B] float32 (0.0 = off), None when no random row uses min-p.
    repetition_penalties, presence_penalties, frequency_penalties: [B] float32 each (1.0, 0.0,
        0.0 = off); all three None when no row uses a penalty.
    prompt_token_ids, output_token_ids: per row, the tokens the penalties look at; None when no
        row uses a penalty.
    seeds: per row, the request's seed (any int that fits 64 bits).
    positions: per row, the index of the token being sampled (= tokens of the request so far).
        The random numbers of a row depend only on (seed, position).
    masked_token_ids: per row, token ids that may not be sampled this step (EOS and
        stop_token_ids while fewer than min_tokens tokens exist), or None for the row; the
        whole field is None when no row masks anything.
    num_logprobs: per row, how many top logprobs the request wants (None = none); the whole
        field is None when no row wants logprobs.
    grammar_bitmask: [B, ceil(V / 32)] int32 CPU tensor of the tokens each row's grammar allows
        (bit t % 32 of word t // 32 set = token t allowed), or None when no row has a grammar.
    grammar_rows: the rows under a grammar (the other rows of the bitmask are not read).
    """

    all_greedy: bool
    random_rows: list[int]
    temperature: torch.Tensor | None
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    prompt_token_ids: list[Sequence[int]] | None
    output_token_ids: list[Sequence[int]] | None
    seeds: list[int]
    positions: list[int]
    masked_token_ids: list[list[int] | None] | None
    num_logprobs: list[int | None] | None
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None

    @property
    def argmax_only(self) -> bool:
        """True when sampling is one argmax: all greedy, no penalties, no masks, no logprobs."""
        return (self.all_greedy and self.repetition_penalties is None
                and self.masked_token_ids is None and self.num_logprobs is None
                and self.grammar_bitmask is None)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @property
    def max_num_logprobs(self) -> int | None:
        """The most top logprobs any row wants, or None when no row wants logprobs."""
        if self.num_logprobs is None:
            return None
        return max(n for n in self.num_logprobs if n is not None)


def min_tokens_masked_ids(params: SamplingParams, num_output_tokens: int,
                          eos_token_ids: Collection[int]) -> list[int] | None:
    """Token ids to forbid for the next token, or None.

    While fewer than `min_tokens` tokens have been generated (vLLM's rule), the stop token ids
    and, unless `ignore_eos`, the EOS ids may not be sampled.
    """
    if num_output_tokens >= params.min_tokens:
        return None
    masked = list(params.stop_token_ids)
    if not params.ignore_eos:
        masked.extend(eos_token_ids)
    return masked or None


def uses_penalty(params: SamplingParams) -> bool:
    """True if the request applies a repetition, presence or frequency penalty."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def samples_by_argmax(states: Sequence[SamplingState], *,
                      eos_token_ids: Collection[int]) -> bool:
    """True when `build_sampling_metadata(states, ...)` would be `argmax_only` (every row
    greedy, no penalty, no min_tokens mask, no logprobs), decided without building it; the
    caller checks grammars itself. One Python pass, no tensor."""
    for state in states:
        params = state.sampling_params
        if (params.temperature >= GREEDY_TEMPERATURE or uses_penalty(params)
                or params.logprobs is not None
                or params.min_tokens and min_tokens_masked_ids(
                    params, len(state.token_ids) - state.num_prompt_tokens,
                    eos_token_ids) is not None):
            return False
    return True


def build_sampling_metadata(states: Sequence[SamplingState], device: torch.device | str, *,
                            eos_token_ids: Collection[int]) -> SamplingMetadata:
    """Gather the settings of the B requests that sample this step (in logits row order).

    Args:
        states: one per logits row; see `SamplingState`.
        device: where the tensors go (the logits' device).
        eos_token_ids: the model's EOS ids, masked out while a request is below min_tokens.
    """
    params = [s.sampling_params for s in states]
    random_rows = [r for r, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE]
    penalized = any(uses_penalty(p) for p in params)
    masked = [min_tokens_masked_ids(p, len(s.token_ids) - s.num_prompt_tokens, eos_token_ids)
              if p.min_tokens else None for p, s in zip(params, states)]
    any_masked = any(m is not None for m in masked)
    any_logprobs = any(p.logprobs is not None for p in params)

    def row_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    rand = [params[r] for r in random_rows]
    temperature = top_p = top_k = min_p = None
    if rand:
        temperature = row_tensor([max(p.temperature, GREEDY_TEMPERATURE) for p in params],
                                 torch.float32)
        if any(p.top_p < 1.0 for p in rand):
            top_p = row_tensor([p.top_p for p in params], torch.float32)
        if any(p.top_k > 0 for p in rand):
            top_k = row_tensor([max(p.top_k, 0) for p in params], torch.int64)
        if any(p.min_p > 0.0 for p in rand):
            min_p = row_tensor([p.min_p for p in params], torch.float32)
    repetition = presence = frequency = prompt_ids = output_ids = None
    if penalized:
        repetition = row_tensor([p.repetition_penalty for p in params], torch.float32)
        presence = row_tensor([p.presence_penalty for p in params], torch.float32)
        frequency = row_tensor([p.frequency_penalty for p in params], torch.float32)
        prompt_ids = [s.token_ids[:s.num_prompt_tokens] for s in states]
        output_ids = [s.token_ids[s.num_prompt_tokens:] for s in states]
    return SamplingMetadata(
        all_greedy=not rand,
        random_rows=random_rows, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalties=repetition, presence_penalties=presence,
        frequency_penalties=frequency, prompt_token_ids=prompt_ids, output_token_ids=output_ids,
        seeds=[s.seed for s in states], positions=[len(s.token_ids) for s in states],
        masked_token_ids=masked if any_masked else None,
        num_logprobs=[p.logprobs for p in params] if any_logprobs else None)
