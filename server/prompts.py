"""Prompts -> token ids: the chat template for /v1/chat/completions, the four prompt shapes of
/v1/completions. Bad input (image parts, a template that refuses the conversation, token ids out
of the vocabulary) is a 400 that says what to send instead.

The chat template is rendered to text, then encoded with `add_special_tokens=False`: the template
already writes the BOS token where the model wants one, and a second BOS changes the output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from deepinfer.engine.errors import outside_vocabulary
from deepinfer.server.errors import APIError, check_unicode
from deepinfer.server.protocol import ChatMessage
from deepinfer.server.tools import ToolConfig, template_inputs

_NON_TEXT_PARTS = {"image_url", "input_audio", "audio_url", "video_url", "file", "input_image"}


def _content_parts(message: ChatMessage, index: int) -> list[dict[str, Any]]:
    """A vision-language model's content: a list of {"type": "text", "text"} and
    {"type": "image"} parts (its chat template renders the image markers)."""
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.type in ("image_url", "input_image"):
                parts.append({"type": "image"})
            else:   # text or refusal; anything else gets `_flatten_content`'s 400
                text = _flatten_content(message.model_copy(update={"content": [part]}), index)
                parts.append({"type": "text", "text": text})
        return parts
    return [{"type": "text", "text": _flatten_content(message, index)}]


def _flatten_content(message: ChatMessage, index: int) -> str:
    if message.content is None:
        if message.role != "assistant":   # only an assistant turn (tool calls) may omit it
            raise APIError(f"messages[{index}].content is missing or null; a '{message.role}' "
                           "message needs content: a string or a list of text parts.",
                           param=f"messages[{index}].content", code="invalid_value")
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.type in _NON_TEXT_PARTS:
            raise APIError(f"{where} is an '{part.type}' part, but this model accepts text "
                           "only; send text parts only.", param=where,
                           code="unsupported_content")
        if part.type == "refusal" and message.role == "assistant":
            if part.refusal is None:
                raise APIError(f"{where} is a refusal part without 'refusal'; add its text.",
                               param=where, code="invalid_value")
            texts.append(part.refusal)
            continue
        if part.type != "text":
            raise APIError(f"{where} has unknown type '{part.type}'; use "
                           "{\"type\": \"text\", \"text\": ...}.", param=where,
                           code="invalid_value")
        if part.text is None:
            raise APIError(f"{where} is a text part without 'text'; add the text.",
                           param=where, code="invalid_value")
        texts.append(part.text)
    return "\n".join(texts)


def chat_template_messages(messages: list[ChatMessage], multimodal: bool = False
                           ) -> list[dict[str, Any]]:
    """OpenAI messages -> the dicts chat templates expect (content as one string; for a
    `multimodal` model a list of text and image parts, as SmolVLM's template wants).

    `developer` (OpenAI's newer name for system) is passed as `system`, which templates know.
    """
    if not messages:
        raise APIError("messages is empty; send at least one message, e.g. "
                       "[{\"role\": \"user\", \"content\": \"Hello\"}].", param="messages",
                       code="empty_messages")
    rendered = []
    for i, message in enumerate(messages):
        extra = {k: v for k, v in (message.model_extra or {}).items() if v is not None}
        if multimodal:
            content = _content_parts(message, i)
            for part in content:
                check_unicode(part.get("text", ""), f"messages[{i}].content")
        else:
            content = _flatten_content(message, i)
            check_unicode(content, f"messages[{i}].content")   # not its place in the template
        item = {**extra, "role": "system" if message.role == "developer" else message.role,
                "content": content}
        if message.name is not None:
            item["name"] = message.name
        rendered.append(item)
    return rendered


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer: Any) -> int:
    """Longest vocabulary entry in characters: no token decodes to more characters. Cached;
    `build_app` fills the cache at startup (a 49k-token vocabulary took ~0.3 s on a busy
    2-core box, which the first text request of each API server process paid)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


def check_text(text: str, tokenizer: Any, max_model_len: int, param: str) -> None:
    """Refuse text that is not valid Unicode, or so long that it must exceed the context window,
    before spending time to tokenize it.

    Raises:
        APIError: 400 naming the problem and the fix.
    """
    check_unicode(text, param)
    if len(text) > max_model_len * max_token_chars(tokenizer):
        raise APIError(f"{param} has {len(text)} characters, more than max_model_len="
                       f"{max_model_len} tokens can hold; shorten it.", param=param,
                       code="context_length_exceeded")


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], max_model_len: int,
                    tools: ToolConfig | None = None, mm_processor: Any = None,
                    images: list | None = None) -> list[int]:
    """Render the chat template with a generation prompt and encode it (no second BOS).

    `tools` (server.tools) puts the offered functions and the tool turns into the prompt.
    `mm_processor` (a vision-language model's `engine.mm_processor.MultiModalProcessor`):
    content goes to the template as parts, and each image marker is expanded into the
    placeholder tokens of `images` (their `ProcessedImage`s, in prompt order)."""
    conversation, template_kwargs = template_inputs(
        tokenizer, chat_template_messages(messages, multimodal=mm_processor is not None), tools)
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=False, **template_kwargs)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise APIError(f"The model's chat template rejected these messages: {exc}. Adjust the "
                       "conversation (roles, order) or use /v1/completions with a raw prompt.",
                       param="messages", code="invalid_messages") from None
    if mm_processor is not None:
        try:
            text = mm_processor.expand(text, images or [])
        except ValueError as exc:
            raise APIError(str(exc), param="messages", code="invalid_value") from None
    check_text(text, tokenizer, max_model_len, "messages")
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class Prompt:
    """One prompt of a completions request: its token ids and its text (for `echo`)."""

    token_ids: list[int]
    text: str


def _check_ids(ids: list[int], vocab_size: int, where: str) -> None:
    if message := outside_vocabulary(ids, vocab_size, where):
        raise APIError(message, param="prompt", code="invalid_value")


def completion_prompts(tokenizer: Any, prompt: Any, max_model_len: int) -> list[Prompt]:
    """A string, list of strings, list of token ids or list of lists of ids -> prompts.

    Text is encoded with the tokenizer's special tokens (a BOS where the model has one), as
    vLLM does for completions.
    """
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt is an empty list; send a string, a list of strings or token ids.",
                       param="prompt", code="empty_prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    vocab_size = len(tokenizer)
    prompts = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            check_text(item, tokenizer, max_model_len, "prompt")
            prompts.append(Prompt(list(tokenizer.encode(item, add_special_tokens=True)), item))
            continue
        _check_ids(item, vocab_size, f"prompt[{i}]")
        prompts.append(Prompt(list(item), tokenizer.decode(item)))
    return prompts
