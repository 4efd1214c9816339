"""SamplingParams refuses what it cannot honour with a SamplingParamsError (a ValueError) that
names the field, as the server's 400s do; found by black-box testing of the offline API, where
max_tokens=3.5 generated 4 tokens and temperature="0.5" raised a bare TypeError."""

import pytest

from deepinfer.engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("fields, param, message", [
    ({"max_tokens": 3.5}, "max_tokens", "must be an integer or None"),
    ({"max_tokens": True}, "max_tokens", "must be an integer or None"),
    ({"n": 2.5}, "n", "must be an integer"),
    ({"temperature": "0.5"}, "temperature", "must be a number"),
    ({"top_k": None}, "top_k", "must be an integer"),
    ({"stop": 5}, "stop", "a string or a list of strings"),
    ({"stop_token_ids": 7}, "stop_token_ids", "a list of token ids"),
    ({"so_args": "json"}, "so_args", "must be a dict"),
    ({"so_args": {"schema_type": "regex", "schema": "a+", "foo": 1}}, "so_args",
     r"unknown keys \['foo'\]"),
    ({"temperature": float("inf")}, "temperature", "temperature=inf is not a finite number"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "not a finite number"),
])
def test_wrong_types_name_the_field(fields, param, message):
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**fields)
    assert info.value.param == param


def test_stop_strings_with_so_args_are_refused_as_over_http():
    with pytest.raises(ValueError, match="stop=.'x'. cannot be combined with so_args"):
        SamplingParams(stop=["x"], so_args={"schema_type": "regex", "schema": "a+"})
    SamplingParams(stop_token_ids=[2], so_args={"schema_type": "regex", "schema": "a+"})


def test_well_typed_values_pass():
    params = SamplingParams(temperature=0, top_p=1, max_tokens=None, logprobs=None, seed=None,
                            stop="end", stop_token_ids=(3,))
    assert params.stop == ["end"] and params.stop_token_ids == [3]


def test_fan_out_seeds_choice_j_with_seed_plus_j():
    assert [p.seed for p in SamplingParams(seed=2**64 - 2, n=3).fan_out()] == [
        2**64 - 2, 2**64 - 1, 0]
    assert [(p.seed, p.n) for p in SamplingParams(seed=-5).fan_out(2)] == [(-5, 1), (-4, 1)]
    copies = SamplingParams(n=2).fan_out()
    assert [p.seed for p in copies] == [None, None] and copies[0] is not copies[1]


BIG, NEG, I32 = 2**63, -(2**63) - 1, 2**31


@pytest.mark.parametrize("fields, param, message", [
    ({"top_k": BIG}, "top_k", rf"top_k={BIG} is outside \[-1, 2147483647\]"),
    ({"top_k": NEG}, "top_k", rf"top_k={NEG} is outside"),
    ({"top_k": I32}, "top_k", rf"top_k={I32} is outside"),
    ({"max_tokens": BIG}, "max_tokens", rf"max_tokens={BIG} is outside \[1, 2147483647\]"),
    ({"min_tokens": NEG}, "min_tokens", "is outside"),
    ({"n": I32}, "n", "is outside"),
    ({"seed": 2**64}, "seed", "is outside"),
    ({"seed": NEG}, "seed", "is outside"),
    ({"logprobs": BIG}, "logprobs", "between 0 and 20"),
    ({"stop_token_ids": [3, BIG]}, "stop_token_ids", r"\[0, 2147483647\]"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "integers"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop", "65 stop strings given; at most 64"),
    ({"stop": ["x" * 513]}, "stop", "at most 512 characters long; one has 513"),
    ({"temperature": float("nan")}, "temperature", "temperature=nan is not a finite"),
    ({"top_p": float("nan")}, "top_p", "not a finite"),
    ({"min_p": float("nan")}, "min_p", "not a finite"),
    ({"presence_penalty": float("-inf")}, "presence_penalty", "not a finite"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "not a finite"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty", "not a finite"),
])
def test_values_the_engine_cannot_represent_are_refused(fields, param, message):
    """LLM.generate users get a ValueError naming the field (issue 26.1: top_k = 2**63 killed
    the step loop)."""
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**fields)
    assert info.value.param == param


def test_the_largest_representable_values_pass():
    SamplingParams(top_k=2**31 - 1, max_tokens=2**31 - 1, min_tokens=2**31 - 1,
                   stop_token_ids=[2**31 - 1], seed=2**64 - 1)
    SamplingParams(top_k=-1, seed=-(2**63), n=2**31 - 1, temperature=1e300)
    SamplingParams(stop=[f"{i}" + "x" * 510 for i in range(64)])
