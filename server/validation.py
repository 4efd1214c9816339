"""Request values -> `SamplingParams`, with OpenAI's ranges and messages a client can act on.

Pure functions of the parsed request and a few numbers (served model name, context window), so
tests need no engine. Every failure is an `APIError` (400, or 404 for an unknown model) that
names the parameter, the value it got and what to send instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from deepinfer.engine.sampling_params import MAX_INT32, SEED_RANGE, SamplingParams
from deepinfer.server.errors import APIError, check_unicode, param_path, spelled
from deepinfer.server.protocol import (CHAT_FIELDS_NOT_SERVED, ChatCompletionRequest, CompletionRequest,
                             KVTransferParams, SamplingFields)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 100.0


def _in_range(name: str, value: float | None, low: float, high: float, *,
              low_open: bool = False) -> None:
    """400 naming `name`, its value and the interval unless value is None or inside it (NaN
    and infinities are outside every interval)."""
    if value is None:
        return
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bounds = [f"{b:g}" if isinstance(b, float) else str(b) for b in (low, high)]
        interval = f"{'(' if low_open else '['}{bounds[0]}, {bounds[1]}]"
        raise APIError(f"{name}={value} is outside {interval}; send a value in {interval}.",
                       param=name, code="invalid_value")


def _check_numbers(req: SamplingFields) -> None:
    """Every number of the request inside what the engine can represent (a count or token id
    fits int32, a seed 64 bits, a float is finite and in its range), before any reaches a
    step: one out-of-range value used to kill the step loop for every request."""
    _in_range("n", req.n, 1, MAX_N)
    _in_range("temperature", req.temperature, 0.0, 2.0)
    _in_range("top_p", req.top_p, 0.0, 1.0, low_open=True)
    _in_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _in_range("top_k", req.top_k, -1, MAX_INT32)
    _in_range("min_p", req.min_p, 0.0, 1.0)
    _in_range("repetition_penalty", req.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
              low_open=True)
    _in_range("min_tokens", req.min_tokens, 0, MAX_INT32)
    _in_range("seed", req.seed, *SEED_RANGE)
    _in_range("seq_seed", req.seq_seed, *SEED_RANGE)
    for i, token_id in enumerate(req.stop_token_ids or []):
        _in_range(f"stop_token_ids[{i}]", token_id, 0, MAX_INT32)
    for token, bias in (req.logit_bias or {}).items():
        _in_range(f"logit_bias.{token}", bias, -100.0, 100.0)


def check_model(requested: str | None, served: str) -> None:
    """404 `model_not_found` unless `requested` is the served model (or omitted)."""
    if requested is not None and requested != served:
        raise APIError(f"The model `{requested}` does not exist; this server serves "
                       f"`{served}` (see GET /v1/models).", status_code=404,
                       param="model", code="model_not_found")


def _seed(seed: int | None, seq_seed: int | None) -> int | None:
    if seed is not None and seq_seed is not None and seed != seq_seed:
        raise APIError(f"seed={seed} and seq_seed={seq_seed} disagree; send only one of them.",
                       param="seq_seed", code="invalid_value")
    return seed if seed is not None else seq_seed


def _common_kwargs(req: SamplingFields) -> dict[str, Any]:
    _check_numbers(req)
    if req.logit_bias:
        raise APIError("logit_bias is not supported by this server; remove it.",
                       param="logit_bias", code="unsupported_parameter")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    for i, text in enumerate(stop):
        check_unicode(text, "stop" if isinstance(req.stop, str) else f"stop[{i}]")
    if req.cache_salt is not None:
        check_unicode(req.cache_salt, "cache_salt")
        if not req.cache_salt:
            raise APIError("cache_salt is empty; send a non-empty string or omit it.",
                           param="cache_salt", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream=true; set stream=true or "
                       "remove stream_options.", param="stream_options", code="invalid_value")
    return {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "min_tokens": req.min_tokens or 0,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": bool(req.ignore_eos),
        "seed": _seed(req.seed, req.seq_seed),
        "skip_special_tokens": req.skip_special_tokens is not False,
        "cache_salt": req.cache_salt,
    }


def _check_max_tokens(name: str, value: int | None, omitted: str) -> None:
    """400 unless value is None or in [1, 2**31 - 1]; `omitted`: what leaving it out does."""
    if value is not None and value < 1:
        raise APIError(f"{name}={value} must be >= 1; send a positive number of tokens or omit "
                       f"it to {omitted}.", param=name, code="invalid_value")
    _in_range(name, value, 1, MAX_INT32)


def _check_not_served(req: ChatCompletionRequest) -> None:
    """OpenAI chat fields this server does not serve are refused unless null (`modalities`
    unless ["text"])."""
    for name, fix in CHAT_FIELDS_NOT_SERVED.items():
        if getattr(req, name) is not None:
            raise APIError(f"'{name}' is not supported by this server: {fix}. Remove it or send "
                           "null.", param=name, code="unsupported_parameter")
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise APIError(f"modalities={spelled(req.modalities)} asks for output this server cannot "
                       "produce; it produces text only: send [\"text\"] or omit modalities.",
                       param="modalities", code="unsupported_parameter")


def max_tokens_field(req: ChatCompletionRequest) -> str:
    """The chat field that sets max_tokens: `max_completion_tokens` (OpenAI's current name)
    wins over the deprecated `max_tokens`."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def chat_kwargs(req: ChatCompletionRequest) -> tuple[dict[str, Any], int | None]:
    """Validated SamplingParams keyword arguments (without max_tokens) and the max_tokens asked.

    The max_tokens asked is that of `max_tokens_field`.
    """
    kwargs = _common_kwargs(req)
    _check_not_served(req)
    for name in ("max_tokens", "max_completion_tokens"):
        _check_max_tokens(name, getattr(req, name), "generate up to the context window")
    _in_range("top_logprobs", req.top_logprobs, 0, MAX_LOGPROBS)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(f"top_logprobs={req.top_logprobs} needs logprobs=true; set logprobs=true "
                       "or remove top_logprobs.", param="top_logprobs", code="invalid_value")
    kwargs["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return kwargs, getattr(req, max_tokens_field(req))


COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_kwargs(req: CompletionRequest) -> tuple[dict[str, Any], int | None]:
    """Validated SamplingParams keyword arguments (without max_tokens) and max_tokens asked
    (None when omitted: `fit_max_tokens(..., default=COMPLETIONS_DEFAULT_MAX_TOKENS)` then
    generates up to 16 tokens, OpenAI's legacy default, fewer where the context has less room).
    """
    kwargs = _common_kwargs(req)
    _check_max_tokens("max_tokens", req.max_tokens,
                      f"generate up to {COMPLETIONS_DEFAULT_MAX_TOKENS} tokens (the default)")
    _in_range("logprobs", req.logprobs, 0, MAX_LOGPROBS)
    _in_range("best_of", req.best_of, 1, MAX_N)
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(f"best_of={req.best_of} differs from n={n}; this server does not rank "
                       "candidates, so send best_of equal to n or omit it.", param="best_of",
                       code="unsupported_value")
    if req.suffix:
        raise APIError("suffix (fill-in-the-middle) is not supported by this model; remove it.",
                       param="suffix", code="unsupported_parameter")
    if req.echo and req.logprobs is not None:
        raise APIError("echo with logprobs needs prompt logprobs, which this server does not "
                       "compute; drop echo or logprobs.", param="echo",
                       code="unsupported_parameter")
    kwargs["logprobs"] = req.logprobs
    return kwargs, req.max_tokens


def check_completion_fields(req: CompletionRequest) -> None:
    """400 for a chat body sent to /v1/completions (`messages`), or one without `prompt`."""
    if req.messages is not None:
        raise APIError("'messages' is a chat field: /v1/completions takes a 'prompt'. Send "
                       "this request to /v1/chat/completions, or send a prompt here instead.",
                       param="messages", code="unknown_parameter")
    if req.prompt is None:
        raise APIError("Missing required parameter: 'prompt'.", param="prompt",
                       code="missing_required_parameter")


def fit_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int, *,
                   prompt_param: str = "prompt", default: int | None = None,
                   max_tokens_param: str = "max_tokens") -> int:
    """The max_tokens to run with: as asked if it fits; if not asked, `default` (None: no
    limit) cut to the room the context window leaves, as vLLM's `get_max_tokens` does, so a
    default the client never sent is never blamed. Raises a 400 with the numbers when the
    prompt leaves no room or prompt + the asked max_tokens cannot fit, naming the field the
    client sent (`max_tokens_param`: chat's `max_tokens_field`)."""
    if num_prompt_tokens == 0:
        raise APIError("The prompt is empty after tokenization; send some text or token ids.",
                       param=prompt_param, code="empty_prompt")
    if num_prompt_tokens >= max_model_len:
        raise APIError(f"The prompt has {num_prompt_tokens} tokens, which fills "
                       f"max_model_len={max_model_len} and leaves no room to generate; "
                       "shorten the prompt or serve with a larger --max-model-len.",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        room = max_model_len - num_prompt_tokens
        return room if default is None else min(default, room)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(f"{max_tokens_param}={max_tokens} plus {num_prompt_tokens} prompt tokens "
                       f"exceeds max_model_len={max_model_len}; lower {max_tokens_param} to at "
                       f"most {max(max_model_len - num_prompt_tokens, 0)} or shorten the "
                       "prompt.", param=max_tokens_param, code="context_length_exceeded")
    return max_tokens


def build_params(kwargs: dict[str, Any], max_tokens: int) -> SamplingParams:
    """SamplingParams from validated kwargs; its own checks (min_p, top_k, ...) become 400s."""
    if kwargs.get("so_args") is not None:   # named in API terms rather than the engine's so_args
        # a stop string would cut the output before its grammar is complete (invalid JSON
        # reported as finished); stop_token_ids are fine: the grammar allows them only at the end
        for name in ("ignore_eos", "min_tokens", "stop"):
            if kwargs.get(name):
                raise APIError(f"{name}={spelled(kwargs[name])} cannot be combined with structured "
                               "outputs (response_format, structured_outputs, guided_*) or a "
                               "'required' / named tool_choice: the output ends where its "
                               f"grammar is complete; drop {name}.", param=name,
                               code="invalid_value")
    try:
        return SamplingParams(max_tokens=max_tokens, **kwargs)
    except ValueError as exc:   # SamplingParamsError names the field
        raise APIError(f"{exc} Fix the value and retry.", param=getattr(exc, "param", None),
                       code="invalid_value") from None


def check_kv_transfer_params(req: SamplingFields, num_choices: int) -> dict[str, Any] | None:
    """The request's `kv_transfer_params` (prefill/decode disaggregation), checked: a prefill
    hand-off (`do_remote_decode`) answers with one JSON body for one choice."""
    params = req.kv_transfer_params
    if params:
        _check_kv_transfer_types(params)
    if params and params.get("do_remote_decode"):
        if num_choices != 1:
            raise APIError(f"kv_transfer_params.do_remote_decode needs exactly one choice, got "
                           f"{num_choices} (n times prompts); send n=1 and a single prompt.",
                           param="kv_transfer_params", code="invalid_value")
        if req.stream:
            raise APIError("kv_transfer_params.do_remote_decode needs stream=false: the "
                           "prefill's hand-off is returned in one JSON body.",
                           param="kv_transfer_params", code="invalid_value")
    return params


def _check_kv_transfer_types(params: dict[str, Any]) -> None:
    """400 naming the first `kv_transfer_params` value of the wrong type or range."""
    try:
        KVTransferParams.model_validate(params)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = param_path(error["loc"])
        value = spelled(error.get("input"))
        value = value if len(value) <= 40 else value[:37] + "..."
        if name in ("do_remote_decode", "do_remote_prefill"):
            fix = "must be true or false (a JSON boolean)"
        elif name == "model_fingerprint":
            fix = "must be a string (as a prefill worker returned it)"
        else:
            fix = f"is invalid ({error['msg']}); send it as a prefill worker returned it"
        raise APIError(f"kv_transfer_params.{name}={value} {fix}.", param="kv_transfer_params",
                       code="invalid_type") from None
