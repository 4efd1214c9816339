"""`OutputProcessor`: the engine's new tokens -> `RequestOutput`s with text, stop strings applied.

Owned by the step loop (EngineCore); it keeps one `_RequestState` per unfinished request: an
`IncrementalDetokenizer`, the text so far and how much of it was sent, the output token ids and
logprobs. `process()` is called once per step with that step's `EngineCoreOutput`s.

Rules (vLLM's, unless said otherwise):
- Token-level stops (EOS, stop_token_ids: `finish_reason == "stop"` with a non-string
  `stop_reason`) do not put the stop token's text in the output, whatever
  `skip_special_tokens` says; the token stays in `token_ids` and its logprob in `logprobs`.
- Stop strings are text-level: found here, never in the output text, also when they span
  tokens. Of several matches in one step, the one that ends first wins (it would have stopped a
  character-by-character stream first); at equal ends, the longer one. The text is cut before
  it; `token_ids` and `logprobs` keep every generated token (the tokens that made the stop
  string, and any sampled after it in the same step, were generated; only the text is cut).
- Hold-back: while a request runs, the longest suffix of its text that is a proper prefix of a
  stop string is not sent (at most max stop length - 1 characters, and usually none: vLLM holds
  back that many always). So a client never sees a prefix of a stop string that later matches;
  the held text is released when it stops being a possible prefix or when the request finishes.
- A finished request's last `RequestOutput` carries the whole `text`, `token_ids`, `logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.engine.outputs import EngineCoreOutput, RequestMetrics, RequestOutput, TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams


@dataclass
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None   # None unless params.logprobs is not None
    text: str = ""                                # output text so far, cut at a stop string
    num_sent_chars: int = 0                       # characters of `text` already streamed


def find_stop_string(text: str, searched_chars: int,
                     stop: list[str]) -> tuple[int, str] | None:
    """The stop string that ends first in `text` at or after `searched_chars`, and its start.

    Args:
        text: the request's text so far.
        searched_chars: len(text) when it was last checked (no match ended before that).
        stop: stop strings, non-empty.
    Returns:
        (start index, stop string) or None. At equal ends the longer (earlier-starting) wins.
    """
    best: tuple[int, int, str] | None = None    # (end, start, string)
    for stop_string in stop:
        start = text.find(stop_string, max(0, searched_chars - len(stop_string) + 1))
        if start < 0:
            continue
        candidate = (start + len(stop_string), start, stop_string)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[1], best[2])


def held_back_chars(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    Only the suffixes starting with a stop string's first character are compared (found by
    `str.find` over the last len - 1 characters), longest first: per stop string a scan of its
    length plus one comparison per occurrence of its first character, where comparing every
    suffix length cost the square of its length (a request's 64 strings of 512 characters
    are the most, `SamplingParams`)."""
    held, end = 0, len(text)
    for stop_string in stop:
        longest = min(len(stop_string) - 1, end)
        if longest <= held:
            continue
        first = stop_string[0]
        start = text.find(first, end - longest, end - held)
        while start >= 0:
            if stop_string.startswith(text[start:]):
                held = end - start
                break
            start = text.find(first, start + 1, end - held)
    return held


class OutputProcessor:
    """Detokenizes, applies stop strings and builds `RequestOutput`s (see the module doc).

    Args:
        tokenizer: a Hugging Face tokenizer (only `decode` is used).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float) -> None:
        """Start tracking a request. `arrival_time` is time.monotonic() seconds."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running; give each "
                             "request a unique id.")
        detokenizer = IncrementalDetokenizer(self._tokenizer, prompt_token_ids,
                                             sampling_params.skip_special_tokens)
        self._requests[request_id] = _RequestState(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=sampling_params,
            detokenizer=detokenizer, metrics=RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if sampling_params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> None:
        """Forget a request (client gone); no further output is produced. Unknown ids are
        ignored (the request may have finished in the same step)."""
        self._requests.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput],
                now: float) -> tuple[list[RequestOutput], list[str]]:
        """One step's engine outputs -> (a RequestOutput per tracked request in `outputs`,
        ids of requests a stop string finished, which the engine must finish in the scheduler).

        Args:
            now: time.monotonic() seconds, stamped into the metrics.
        """
        request_outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:                      # aborted while the step ran
                continue
            request_output = self._process_one(state, output, now)
            request_outputs.append(request_output)
            if request_output.finished:
                del self._requests[output.request_id]
                if output.finish_reason is None:   # the scheduler still holds it
                    stopped_by_string.append(output.request_id)
        return request_outputs, stopped_by_string

    def _process_one(self, state: _RequestState, output: EngineCoreOutput,
                     now: float) -> RequestOutput:
        new_token_ids = list(output.new_token_ids)
        new_logprobs = output.new_logprobs if state.logprobs is not None else None
        if new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now

        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        token_stop = finish_reason == "stop" and not isinstance(stop_reason, str)
        stop = state.params.stop
        shown = new_token_ids[:-1] if token_stop else new_token_ids
        match = None
        if stop and len(shown) > 1:
            # a step that committed drafts: a stop string that ends at one of its tokens ends
            # the output there, the tokens after it (and their logprobs) dropped, as the
            # token-a-step path would have ended it
            match, kept = self._detokenize_until_stop(state, shown)
            if match is not None:
                del new_token_ids[kept:]
                new_logprobs = new_logprobs[:kept] if new_logprobs else new_logprobs
                finish_reason = "stop"
        else:
            searched_chars = len(state.text)
            state.text += state.detokenizer.step(shown)
            if stop and len(state.output_token_ids) + len(new_token_ids) > (
                    state.params.min_tokens):
                match = find_stop_string(state.text, searched_chars, stop)
        state.output_token_ids.extend(new_token_ids)
        if new_logprobs:
            state.logprobs.extend(new_logprobs)
        if finish_reason is not None and match is None:
            searched_chars = len(state.text)
            state.text += state.detokenizer.flush()
            if stop and len(state.output_token_ids) > state.params.min_tokens:
                match = find_stop_string(state.text, searched_chars, stop)
        if match is not None:
            start, stop_string = match
            state.text = state.text[:start]
            finish_reason, stop_reason = "stop", stop_string
        finished = finish_reason is not None

        send_end = len(state.text) if finished or not stop else (
            len(state.text) - held_back_chars(state.text, stop))
        new_text = state.text[state.num_sent_chars:send_end]
        state.num_sent_chars = max(state.num_sent_chars, send_end)
        if finished:
            state.metrics.finished_time = now
        return RequestOutput(
            request_id=state.request_id, prompt_token_ids=state.prompt_token_ids,
            new_token_ids=list(new_token_ids), new_text=new_text, new_logprobs=new_logprobs,
            num_output_tokens=len(state.output_token_ids),
            # EngineCoreOutput does not carry it yet (proposed field); 0 until it does.
            num_cached_tokens=output.num_cached_tokens,
            finished=finished, finish_reason=finish_reason,
            stop_reason=stop_reason if finished else None,
            metrics=RequestMetrics(**state.metrics.__dict__),  # a snapshot
            text=state.text if finished else None,
            token_ids=state.output_token_ids if finished else None,
            logprobs=state.logprobs if finished else None)

    @staticmethod
    def _detokenize_until_stop(state: _RequestState, token_ids: list[int]
                               ) -> tuple[tuple[int, str] | None, int]:
        """Detokenize `token_ids` one at a time into state.text, stopping at the first token
        whose text completes a stop string (counted once more than min_tokens tokens exist,
        as vLLM counts). Returns (find_stop_string's match or None, tokens of token_ids
        kept: up to and including that token, else all)."""
        stop, min_tokens = state.params.stop, state.params.min_tokens
        for index, token_id in enumerate(token_ids):
            searched_chars = len(state.text)
            state.text += state.detokenizer.step([token_id])
            if len(state.output_token_ids) + index + 1 > min_tokens:
                match = find_stop_string(state.text, searched_chars, stop)
                if match is not None:
                    return match, index + 1
        return None, len(token_ids)


class TokenOutputProcessor:
    """`OutputProcessor`'s stand-in in an engine core process: token ids, finish reasons and
    logprobs pass through as `RequestOutput`s without text (`new_text` is ""; `text`,
    `token_ids` and `prompt_token_ids` stay empty). The API server process detokenizes and
    applies stop strings (engine/core_client.py), then aborts a request a stop string ended.
    """

    def __init__(self) -> None:
        self._requests: dict[str, list] = {}     # id -> [num output tokens, RequestMetrics]

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running; give each "
                             "request a unique id.")
        self._requests[request_id] = [0, RequestMetrics(arrival_time=arrival_time)]

    def abort_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput],
                now: float) -> tuple[list[RequestOutput], list[str]]:
        request_outputs = []
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:                      # aborted while the step ran
                continue
            state[0] += len(output.new_token_ids)
            finished = output.finish_reason is not None
            if finished:
                del self._requests[output.request_id]
            request_outputs.append(RequestOutput(
                request_id=output.request_id, prompt_token_ids=[],
                new_token_ids=output.new_token_ids, new_text="",
                new_logprobs=output.new_logprobs, num_output_tokens=state[0],
                num_cached_tokens=output.num_cached_tokens, finished=finished,
                finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                metrics=state[1]))
        return request_outputs, []
