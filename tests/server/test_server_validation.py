"""Request -> SamplingParams translation and its 4xx errors, on pure functions."""

import pytest

from deepinfer.server.errors import APIError
from deepinfer.server.prompts import chat_prompt_ids, completion_prompts
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.server.validation import (build_params, chat_kwargs, check_model, completion_kwargs,
                               fit_max_tokens)
from server_doubles import BOS, CharTokenizer


def chat(**fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_chat_fields_reach_sampling_params():
    kwargs, asked = chat_kwargs(chat(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, stop="END", stop_token_ids=[7],
        ignore_eos=True, min_tokens=2, seed=11, skip_special_tokens=False, max_tokens=50,
        logprobs=True, top_logprobs=3))
    params = build_params(kwargs, 50)
    assert asked == 50
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 40, 0.05)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.1, 0.5, -0.5)
    assert params.stop == ["END"] and params.stop_token_ids == [7]
    assert params.ignore_eos is True and params.min_tokens == 2
    assert params.seed == 11 and params.skip_special_tokens is False
    assert params.logprobs == 3 and params.max_tokens == 50


def test_chat_defaults_are_openai_defaults():
    kwargs, asked = chat_kwargs(chat())
    params = build_params(kwargs, 10)
    assert asked is None
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
    assert params.logprobs is None and params.seed is None and params.stop == []


def test_max_completion_tokens_wins_and_seq_seed_is_seed():
    kwargs, asked = chat_kwargs(chat(max_tokens=5, max_completion_tokens=9, seq_seed=3))
    assert asked == 9
    assert build_params(kwargs, asked).seed == 3


@pytest.mark.parametrize("fields, param, text", [
    ({"temperature": 2.5}, "temperature", "temperature=2.5 is outside [0, 2]"),
    ({"temperature": -0.1}, "temperature", "outside [0, 2]"),
    ({"top_p": 0.0}, "top_p", "top_p=0.0 is outside (0, 1]"),
    ({"top_p": 1.5}, "top_p", "outside (0, 1]"),
    ({"n": 0}, "n", "n=0 is outside [1, 128]"),
    ({"n": 129}, "n", "n=129"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0 must be >= 1"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", "must be >= 1"),
    ({"max_completion_tokens": 2**31}, "max_completion_tokens", "is outside [1, 2147483647]"),
    ({"presence_penalty": 3}, "presence_penalty", "outside [-2, 2]"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "outside [0, 20]"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"seed": 1, "seq_seed": 2}, "seq_seed", "disagree"),
    ({"stop": ["ok", "\udc00"]}, "stop[1]", "lone UTF-16 surrogate"),
    ({"stop": "\ud800x"}, "stop", "lone UTF-16 surrogate"),
])
def test_chat_bad_values_are_400_naming_the_param(fields, param, text):
    with pytest.raises(APIError) as info:
        chat_kwargs(chat(**fields))
    assert info.value.status_code == 400
    assert info.value.param == param
    assert text in info.value.message
    assert info.value.code is not None   # every 400 names its kind, for clients to branch on


def test_openai_fields_not_served_are_accepted_as_null_and_refused_when_set():
    """Clients that send every OpenAI field (nulls included) are served; a field this server
    cannot honour is a 400 saying so (not "unrecognized"), with the fix."""
    nulls = dict.fromkeys(["reasoning_effort", "verbosity", "modalities", "audio", "prediction",
                           "web_search_options", "functions", "function_call",
                           "prompt_cache_key", "safety_identifier"])
    chat_kwargs(chat(**nulls))
    chat_kwargs(chat(modalities=["text"], prompt_cache_key="k", safety_identifier="u"))
    for fields, text in [({"reasoning_effort": "low"}, "separate channel"),
                         ({"audio": {"voice": "alloy"}}, "text only"),
                         ({"functions": [{"name": "f"}]}, "as `tools`"),
                         ({"function_call": "auto"}, "as `tool_choice`"),
                         ({"modalities": ["text", "audio"]}, "text only")]:
        with pytest.raises(APIError) as info:
            chat_kwargs(chat(**fields))
        assert (info.value.param, info.value.code) == (next(iter(fields)),
                                                       "unsupported_parameter")
        assert text in info.value.message


def test_response_format_text_is_accepted():
    kwargs, _ = chat_kwargs(chat(response_format={"type": "text"}, tool_choice="none"))
    assert build_params(kwargs, 4).so_args is None


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("top_k", -5),
                                          ("repetition_penalty", 0),
                                          ("repetition_penalty", float("inf")), ("stop", [""]),
                                          ("stop_token_ids", [-1]), ("seed", 2**64),
                                          ("stop", ["s"] * 65), ("stop", ["x" * 513])])
def test_sampling_params_own_checks_become_400_naming_the_field(field, value):
    kwargs, _ = chat_kwargs(chat())
    kwargs[field] = value   # past the server's own range checks: SamplingParams still refuses
    with pytest.raises(APIError) as info:
        build_params(kwargs, 8)
    err = info.value
    assert (err.status_code, err.param, err.code) == (400, field, "invalid_value")


def test_unknown_model_is_404_model_not_found():
    check_model(None, "m")
    check_model("m", "m")
    with pytest.raises(APIError) as info:
        check_model("gpt-4", "m")
    err = info.value
    assert (err.status_code, err.code, err.param) == (404, "model_not_found", "model")
    assert "`gpt-4` does not exist" in err.message and "`m`" in err.message


def test_fit_max_tokens_fills_the_window_or_explains():
    assert fit_max_tokens(None, 10, 64) == 54
    assert fit_max_tokens(20, 10, 64) == 20
    assert fit_max_tokens(54, 10, 64) == 54
    with pytest.raises(APIError) as info:
        fit_max_tokens(60, 10, 64)
    assert info.value.message == ("max_tokens=60 plus 10 prompt tokens exceeds max_model_len=64; "
                                  "lower max_tokens to at most 54 or shorten the prompt.")
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as info:
        fit_max_tokens(None, 64, 64, prompt_param="messages")
    assert "64 tokens, which fills max_model_len=64" in info.value.message
    assert info.value.param == "messages"
    with pytest.raises(APIError, match="empty"):
        fit_max_tokens(None, 0, 64)


def test_fan_out_offsets_the_seed_per_choice():
    params = build_params(chat_kwargs(chat(seed=41))[0], 5)
    assert [p.seed for p in params.fan_out(3)] == [41, 42, 43]
    unseeded = build_params(chat_kwargs(chat())[0], 5)
    copies = unseeded.fan_out(2)
    assert [p.seed for p in copies] == [None, None] and copies[0] is not copies[1]


def test_completion_kwargs():
    kwargs, asked = completion_kwargs(CompletionRequest(prompt="x", logprobs=2))
    assert asked is None and build_params(kwargs, 3).logprobs == 2  # 16 by default: fit_max_tokens
    with pytest.raises(APIError, match="best_of=3 differs from n=1"):
        completion_kwargs(CompletionRequest(prompt="x", best_of=3))
    with pytest.raises(APIError, match="suffix"):
        completion_kwargs(CompletionRequest(prompt="x", suffix="y"))
    with pytest.raises(APIError, match="echo with logprobs"):
        completion_kwargs(CompletionRequest(prompt="x", echo=True, logprobs=1))
    # found by black-box testing: the advice was the chat endpoint's (up to the context window)
    with pytest.raises(APIError, match=r"omit it to generate up to 16 tokens \(the default\)"):
        completion_kwargs(CompletionRequest(prompt="x", max_tokens=0))


def test_chat_template_is_encoded_without_a_second_bos():
    tok = CharTokenizer()
    request = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    ids = chat_prompt_ids(tok, request.messages, 4096)
    assert ids.count(BOS) == 1 and ids[0] == BOS
    assert tok.decode(ids) == "<s>system: be brief\nuser: a\nb\nassistant: "


@pytest.mark.parametrize("part, text", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "accepts text only"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "accepts text only"),
    ({"type": "hologram"}, "unknown type 'hologram'"),
    ({"type": "text"}, "without 'text'"),
])
def test_content_parts_the_model_cannot_take_are_400(part, text):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [part]}])
    with pytest.raises(APIError) as info:
        chat_prompt_ids(CharTokenizer(), request.messages, 4096)
    assert text in info.value.message and info.value.param == "messages[0].content[0]"


def test_an_assistant_refusal_part_reads_as_its_text():
    tok = CharTokenizer()
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "ok"}]
    as_text = [*messages[:1], {"role": "assistant", "content": "no"}, *messages[2:]]
    assert (chat_prompt_ids(tok, ChatCompletionRequest(messages=messages).messages, 4096)
            == chat_prompt_ids(tok, ChatCompletionRequest(messages=as_text).messages, 4096))
    for message in ({"role": "assistant", "content": [{"type": "refusal"}]},
                    {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}):
        with pytest.raises(APIError, match="refusal part without|unknown type 'refusal'"):
            chat_prompt_ids(tok, ChatCompletionRequest(messages=[message]).messages, 4096)


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_a_message_without_content_is_400_unless_it_is_the_assistants(role):
    with pytest.raises(APIError, match="content is missing or null") as info:
        chat_prompt_ids(CharTokenizer(), ChatCompletionRequest(
            messages=[{"role": role, "content": None}]).messages, 4096)
    assert info.value.param == "messages[0].content"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "ok"}]
    chat_prompt_ids(CharTokenizer(), ChatCompletionRequest(messages=messages).messages, 4096)


def test_template_refusal_and_empty_messages_are_400():
    tok = CharTokenizer()
    with pytest.raises(APIError, match="chat template rejected"):
        chat_prompt_ids(tok, ChatCompletionRequest(
            messages=[{"role": "assistant", "content": "x"}]).messages, 4096)
    with pytest.raises(APIError, match="messages is empty"):
        chat_prompt_ids(tok, [], 4096)


def test_completion_prompt_shapes():
    tok = CharTokenizer()
    assert [p.token_ids for p in completion_prompts(tok, "ab", 4096)] == [[BOS, 97, 98]]
    assert [p.text for p in completion_prompts(tok, ["a", "b"], 4096)] == ["a", "b"]
    single = completion_prompts(tok, [104, 105], 4096)
    assert [(p.token_ids, p.text) for p in single] == [([104, 105], "hi")]
    assert [p.token_ids for p in completion_prompts(tok, [[97], [98, 99]], 4096)] == [
        [97], [98, 99]]
    with pytest.raises(APIError, match="token id 999, outside the vocabulary"):
        completion_prompts(tok, [1, 999], 4096)
    with pytest.raises(APIError, match="empty list"):
        completion_prompts(tok, [], 4096)


def test_lone_surrogates_and_hopelessly_long_text_are_400_before_tokenizing():
    tok = CharTokenizer()
    with pytest.raises(APIError, match="lone UTF-16 surrogate at character 0") as info:
        completion_prompts(tok, "\ud800 hi", 4096)
    assert info.value.status_code == 400 and info.value.param == "prompt"
    with pytest.raises(APIError, match=r"messages\[1\]\.content holds a lone UTF-16 surrogate at "
                                       "character 3") as info:   # not the template's offset
        chat_prompt_ids(tok, ChatCompletionRequest(
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "hi \udfff"}]).messages, 4096)
    assert info.value.param == "messages[1].content"
    with pytest.raises(APIError, match="more than max_model_len=16 tokens can hold") as info:
        completion_prompts(tok, "a" * 17, 16)  # CharTokenizer: one character per token at most
    assert info.value.code == "context_length_exceeded"
    assert APIError("model '\ud800' not found").response().status_code == 400


def test_a_prompt_filling_the_context_says_to_shorten_the_prompt():
    with pytest.raises(APIError, match="leaves no room to generate") as info:
        fit_max_tokens(5, 64, 64)
    assert "lower max_tokens" not in info.value.message
