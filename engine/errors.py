"""Errors the engine raises to its callers (the server maps them to HTTP statuses)."""


class EngineError(Exception):
    """Base class."""


class QueueFullError(EngineError):
    """The waiting queue is at `max_waiting_requests`; the caller should retry later (HTTP 429)."""


class EngineShuttingDownError(EngineError):
    """The server is stopping and the request ran past its drain time; it was aborted (HTTP
    503, the client may retry on another replica)."""


class EngineDeadError(EngineError):
    """The step loop stopped after an internal error; the process must be restarted (HTTP 503)."""


class RequestFailedError(EngineError):
    """A step failed on this request alone (an input, a value or a model path the engine cannot
    handle); the request was stopped and its blocks freed, the engine goes on (HTTP 500, or an
    error event in a stream already started). The message says what failed."""


class PromptTooLongError(ValueError):
    """Prompt + max_tokens does not fit the context window (HTTP 400)."""


def outside_vocabulary(token_ids, vocab_size: int, where: str) -> str | None:
    """The error message for the first of `token_ids` outside [0, vocab_size), naming `where`
    they came from ("the prompt", "stop_token_ids"); None if all are inside."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is None:
        return None
    return (f"{where} holds token id {bad}, outside the vocabulary [0, {vocab_size}); send ids "
            f"the model's tokenizer produces.")
