"""OutputProcessor: stop strings (spanning tokens, overlapping, held back), finish flushes,
EOS text, logprobs and metrics."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.output_processor import OutputProcessor, find_stop_string, held_back_chars
from deepinfer.engine.outputs import EngineCoreOutput, TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams



class CharTokenizer:
    """Token id = code point (ASCII tests); id 0 is a special token "<eos>"."""

    def decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return "".join("" if t == 0 and skip_special_tokens else "<eos>" if t == 0 else chr(t)
                       for t in token_ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(processor, request_id, chunks, finish=None, stop_reason=None, t0=10.0):
    """Feed token chunks (the last with `finish`); return the RequestOutputs and stop lists."""
    results, stopped = [], []
    for step, chunk in enumerate(chunks):
        last = step == len(chunks) - 1
        outs, stop_ids = processor.process(
            [EngineCoreOutput(request_id, chunk, None, finish if last else None,
                              stop_reason if last else None)], now=t0 + step)
        results.extend(outs)
        stopped.extend(stop_ids)
        if outs and outs[-1].finished:
            break
    return results, stopped


def new_processor(stop, tokenizer=None, **params):
    processor = OutputProcessor(tokenizer or CharTokenizer())
    processor.add_request("r", ids("prompt"), SamplingParams(stop=stop, **params), 1.0)
    return processor


def test_stop_string_spanning_tokens_is_cut_and_never_streamed_in_part():
    processor = new_processor(["STOP"])
    outs, stopped = run(processor, "r", [ids("Hello"), ids(" wor"), ids("ldST"), ids("O"),
                                         ids("P and"), ids("more")])
    assert [o.new_text for o in outs] == ["Hello", " wor", "ld", "", ""]
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "STOP"
    assert last.text == "Hello world"
    # the token completing the stop string is the last one kept: a step of several tokens (a
    # verify step's commit) ends where one token a step would have ended
    assert last.token_ids == ids("Hello worldSTOP")
    assert stopped == ["r"] and processor.num_unfinished_requests == 0
    assert all(not o.finished for o in outs[:-1])


def test_stop_strings_wait_for_min_tokens_as_in_vllm():
    """A stop string in the first min_tokens tokens' text is generated through; the first one
    once more than min_tokens tokens exist stops, even if it began before that."""
    processor = new_processor(["ab"], min_tokens=4)
    outs, stopped = run(processor, "r", [ids("ab"), ids("x"), ids("a"), ids("b"), ids("zz")])
    assert outs[-1].finished and outs[-1].stop_reason == "ab" and stopped == ["r"]
    assert outs[-1].text == "abx" and len(outs) == 4   # "ab" over tokens 4-5 stops at token 5
    processor = new_processor(["ab"], min_tokens=4)
    outs, _ = run(processor, "r", [ids("abab"), ids("c")], finish="length")
    assert outs[-1].finish_reason == "length" and outs[-1].text == "ababc"


def test_held_text_is_released_when_it_stops_matching():
    processor = new_processor(["STOP"])
    outs, _ = run(processor, "r", [ids("a ST"), ids("O"), ids("RM")])
    assert [o.new_text for o in outs] == ["a ", "", "STORM"]


def test_overlapping_stop_strings():
    # both end at the same character: the longer one wins (more text is cut)
    processor = new_processor(["bc", "abc"])
    outs, _ = run(processor, "r", [ids("xa"), ids("bcd")])
    assert (outs[-1].text, outs[-1].stop_reason) == ("x", "abc")
    # "bc" ends before "abcd" would: "bc" wins
    processor = new_processor(["abcd", "bc"])
    outs, _ = run(processor, "r", [ids("xabcd")])
    assert (outs[-1].text, outs[-1].stop_reason) == ("xa", "bc")
    # "AB" is held (a prefix of "ABC" and its "B" of "BD"), then "BD" matches: "A" comes out
    processor = new_processor(["ABC", "BD"])
    outs, _ = run(processor, "r", [ids("xAB"), ids("D")])
    assert [o.new_text for o in outs] == ["x", "A"]
    assert (outs[-1].text, outs[-1].stop_reason) == ("xA", "BD")


def test_finish_by_length_flushes_held_back_text():
    processor = new_processor(["STOP"])
    outs, stopped = run(processor, "r", [ids("abc"), ids("ST")], finish="length")
    assert [o.new_text for o in outs] == ["abc", "ST"]
    assert outs[-1].text == "abcST" and outs[-1].finish_reason == "length"
    assert outs[-1].stop_reason is None and stopped == []


def test_stop_string_in_the_step_the_engine_finished_is_reported_as_stop():
    processor = new_processor(["END"])
    outs, stopped = run(processor, "r", [ids("okEND!")], finish="length")
    assert (outs[-1].text, outs[-1].finish_reason, outs[-1].stop_reason) == ("ok", "stop", "END")
    assert stopped == []           # the scheduler already finished it


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_eos_text_is_not_in_the_output(smollm2_tokenizer, skip_special_tokens):
    tokenizer = smollm2_tokenizer
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", tokenizer.encode("<|im_start|>assistant\n"),
                          SamplingParams(skip_special_tokens=skip_special_tokens), 0.0)
    tokens = tokenizer.encode("Hi there 🎉")
    chunks = [[t] for t in tokens] + [[tokenizer.eos_token_id]]
    outs, stopped = run(processor, "r", chunks, finish="stop")
    assert outs[-1].text == "Hi there 🎉" == "".join(o.new_text for o in outs)
    assert outs[-1].token_ids == tokens + [tokenizer.eos_token_id]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert stopped == []


def test_stop_token_id_text_is_not_in_the_output():
    processor = new_processor([], stop_token_ids=[ord("\n")])
    outs, _ = run(processor, "r", [ids("line"), ids("\n")], finish="stop", stop_reason=ord("\n"))
    assert outs[-1].text == "line" and outs[-1].stop_reason == ord("\n")


def test_multibyte_stop_string_over_real_tokens(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams(stop=["🎉"]), 0.0)
    tokens = tokenizer.encode("café 🎉 done")
    outs, stopped = run(processor, "r", [[t] for t in tokens])
    assert outs[-1].text == "café " == "".join(o.new_text for o in outs)
    assert not any("\ufffd" in o.new_text for o in outs)
    assert outs[-1].stop_reason == "🎉" and stopped == ["r"]
    assert outs[-1].token_ids == tokens[:len(outs)]          # tokens up to the match


def test_logprobs_deltas_and_totals_and_metrics():
    processor = new_processor(["!"], logprobs=1)
    logprobs = [TokenLogprobs(ord(c), -0.5, 1, [(ord(c), -0.5)]) for c in "ab!c"]
    steps = [(ids("ab"), logprobs[:2]), (ids("!c"), logprobs[2:])]
    outs = []
    for step, (chunk, lps) in enumerate(steps):
        outs += processor.process([EngineCoreOutput("r", chunk, lps)], now=5.0 + step)[0]
    # the step's tokens after the one completing the stop string ("c") are dropped, with
    # their logprobs: usage and logprobs as one token a step would give them
    assert outs[0].new_logprobs == logprobs[:2] and outs[1].new_logprobs == logprobs[2:3]
    assert outs[-1].logprobs == logprobs[:3] and outs[-1].token_ids == ids("ab!")
    assert outs[-1].text == "ab" and outs[-1].num_output_tokens == 3
    assert outs[-1].new_token_ids == ids("!")
    first, last = outs[0].metrics, outs[-1].metrics
    assert (first.arrival_time, first.first_token_time, first.last_token_time) == (1.0, 5.0, 5.0)
    assert first.finished_time is None
    assert (last.first_token_time, last.last_token_time, last.finished_time) == (5.0, 6.0, 6.0)
    assert outs[0].text is None and outs[0].token_ids is None and outs[0].logprobs is None


def test_no_logprobs_when_not_requested():
    processor = new_processor([])
    lp = [TokenLogprobs(97, -0.1, 1, [])]
    outs, _ = processor.process([EngineCoreOutput("r", [97], lp, "length")], now=2.0)
    assert outs[0].new_logprobs is None and outs[0].logprobs is None


def test_abort_drops_the_request():
    processor = new_processor([])
    processor.abort_request("r")
    processor.abort_request("unknown")
    assert processor.process([EngineCoreOutput("r", [97], None)], now=1.0) == ([], [])
    processor.add_request("x", [1], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="already running"):
        processor.add_request("x", [1], SamplingParams(), 0.0)


def test_random_streams_never_show_text_past_the_cut():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 30)))
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(1, 3))]
        ends = [(text.find(s) + len(s), -len(s), s) for s in stop if s in text]
        expected = text[:min(ends)[0] + min(ends)[1]] if ends else text
        processor = new_processor(stop)
        sent, i, final = "", 0, None
        while final is None:
            size = rng.randint(1, 4)
            chunk, i = ids(text[i:i + size]), i + size
            out = processor.process([EngineCoreOutput("r", chunk, None,
                                                      "length" if i >= len(text) else None)],
                                    now=0.0)[0][0]
            sent += out.new_text
            assert expected.startswith(sent)             # never past the cut, never retracted
            final = out.text if out.finished else None
        assert final == sent == expected


def test_helpers():
    assert held_back_chars("xxAB", ["ABC", "BD"]) == 2
    assert held_back_chars("xxAB", ["Q"]) == 0
    assert find_stop_string("hello world", 0, ["o w", "wor"]) == (4, "o w")
    assert find_stop_string("abcabc", 4, ["abc"]) == (3, "abc")   # ends in the new part
    assert find_stop_string("abcabc", 6, ["abc"]) is None


def test_held_back_chars_equals_comparing_every_suffix_length():
    """`held_back_chars` compares only suffixes that start with a stop string's first
    character; it must hold back exactly what comparing every suffix length does, over texts
    and stop strings of a small alphabet (overlaps, repeats, strings longer than the text)."""
    import random

    def every_length(text, stop):
        held = 0
        for stop_string in stop:
            for length in range(min(len(stop_string) - 1, len(text)), held, -1):
                if text.endswith(stop_string[:length]):
                    held = length
                    break
        return held

    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 8)))
                for _ in range(rng.randint(1, 4))]
        assert held_back_chars(text, stop) == every_length(text, stop), (text, stop)
