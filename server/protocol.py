"""OpenAI API request and response models (pydantic), with vLLM's sampling extras.

Requests check types and shapes only; value ranges and cross-field rules live in
`server.validation`, which can name the offending parameter and the fix in its message.
Unknown request fields are refused (`extra="forbid"`), as OpenAI does, so a typo such as
`max_token` is a 400 instead of being silently ignored. Numbers and flags are not coerced:
integers, floats (an integer is a float) and booleans must arrive as such, not as strings.
Responses are plain models dumped with their `None`s kept, because OpenAI clients expect e.g.
`"logprobs": null`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      field_validator, model_serializer)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------- requests


class ContentPart(_Open):
    """One part of a message's content: `{"type": "text", "text": ...}`, or in an assistant
    message's history `{"type": "refusal", "refusal": ...}` (read as its text)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # an empty parts array is a 400 (OpenAI's "expected at least 1"), like missing content
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None


class StreamOptions(_Request):
    include_usage: StrictBool = False


class JSONSchemaFormat(_Open):
    """`response_format.json_schema`: the schema (`schema` on the wire) and its metadata."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(_Request):
    """Fields /v1/chat/completions and /v1/completions share (OpenAI's plus vLLM's extras)."""

    model: str | None = None  # None = the served model (vLLM's convention)
    n: StrictInt | None = 1
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = False
    seq_seed: StrictInt | None = None
    skip_special_tokens: StrictBool | None = True
    # prefill/decode disaggregation, vLLM's convention: {"do_remote_decode": true} asks a
    # prefill worker to store the prompt's KV; a decode worker gets what the prefill returned
    kv_transfer_params: dict[str, Any] | None = None
    # prefix-cache isolation (vLLM's name): requests with different salts share no cached block
    cache_salt: str | None = None
    # structured outputs (server.structured maps them to so_args)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    response_format: ResponseFormat | None = None   # on /v1/completions too, as vLLM


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # accepted and ignored, as OpenAI clients send them routinely
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI fields this server does not serve (CHAT_FIELDS_NOT_SERVED): accepted when null, as
    # clients that send every field do; otherwise a 400 naming them (`modalities: ["text"]` is
    # what it serves)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


# the OpenAI chat fields above that are refused when set, with the fix to name
CHAT_FIELDS_NOT_SERVED = {
    "reasoning_effort": "this model does not reason in a separate channel",
    "verbosity": "set the length with max_completion_tokens",
    "audio": "this server produces text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "this server has no web search",
    "functions": "send the functions as `tools` (type \"function\")",
    "function_call": "send it as `tool_choice`",
}


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"required": ["prompt"]})
    # required (as the schema says); None here so that a chat body sent to /v1/completions
    # (`messages`, no `prompt`) gets a 400 naming the right endpoint
    # (validation.check_completion_fields)
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    messages: SkipJsonSchema[Any] = None   # not a completions field (left out of the schema)
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_prompts_only(cls, prompt: Any) -> Any:
        """Content parts or vLLM's {"prompt", "multi_modal_data"} objects are a 400 saying
        where images go, not pydantic's "should be a valid string; or ..." union list."""
        items = prompt if isinstance(prompt, list) else [prompt]
        part = next((item for item in items if isinstance(item, dict)), None)
        if part is None:
            return prompt
        what = (f"a content part of type '{part['type']}'" if isinstance(part.get("type"), str)
                else "an object")
        raise PydanticCustomError(
            "text_prompt_only",
            f"the prompt holds {what}; /v1/completions takes text prompts only (a string, a "
            "list of strings, token ids or lists of token ids). Send images to "
            "/v1/chat/completions as 'image_url' parts of a message's content")


class KVTransferParams(_Open):
    """`kv_transfer_params` as this server reads them (engine/kv_transfer.py): a prefill asks
    with `do_remote_decode`; a decode worker gets back what the prefill stored. Keys of other
    connectors (vLLM's NIXL fields) are let through and ignored: the prompt is then recomputed."""

    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    num_stored_tokens: StrictInt | None = Field(default=None, ge=0)
    block_size: StrictInt | None = Field(default=None, ge=1)
    model_fingerprint: str | None = None


# --------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # a prefill worker's hand-off


class DeltaMessage(BaseModel):
    """A stream delta; unset fields are left out (`{}` on the finishing chunk), as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content),
                                  ("tool_calls", self.tool_calls)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill worker's hand-off


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deepinfer"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
