"""Structured outputs on the engine: compile cache, matcher rollback, the sampler's bitmask, and
end-to-end generation whose every finished output validates (jsonschema), fullmatches its regex
or parses under its grammar.

Random weights rarely close a JSON string on their own, so `structured_llama_dir` is the tiny
random Llama with the output embeddings of the tokens holding `"`, `}`, `]` or `,` scaled by 4:
still random, but its generations under a grammar finish within a few dozen tokens. Validity is
asserted for every output that finished with "stop"; that most do is asserted too.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import json
import re
import shutil
import sys
import threading
import time

import jsonschema

import pytest
import torch

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_metadata import build_sampling_metadata
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import GrammarError, check_valid, grammar_key
from deepinfer.engine.structured.backend import MAX_SCHEMA_CHARS
from deepinfer.engine.structured.validity import SUPPORTED_METASCHEMAS
from deepinfer.engine.structured.manager import StructuredOutputManager
from structured_schemas import (ARITHMETIC_EBNF, HAND_WRITTEN, REGEXES, bench_sample,
                                is_exact)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPT = [1, 504, 3158, 28]
MAX_TOKENS = 160
TOP_K = 50  # seeded sampling among the 50 likeliest allowed tokens (cheaper than the full row)


@pytest.fixture(scope="module")
def structured_llama_dir(tiny_llama_dir, tmp_path_factory, smollm2_tokenizer):
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("structured-llama") / "model"
    shutil.copytree(tiny_llama_dir, path)
    weights = load_file(path / "model.safetensors")
    closing = [i for i in range(len(smollm2_tokenizer))
               if any(c in smollm2_tokenizer.decode([i]) for c in '"}],')]
    weights["lm_head.weight"][closing] *= 4.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def make_llm(model_dir, num_blocks=1024, block_size=16, max_num_seqs=32, caching=True) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)))


@pytest.fixture(scope="module")
def llm(structured_llama_dir):
    return make_llm(structured_llama_dir)


def json_params(schema, seed, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=MAX_TOKENS,
                          so_args={"schema_type": "json", "schema": schema}, **kwargs)


def assert_compact(text: str) -> None:
    """No whitespace outside strings but the one space after `,` and `:` (no runaway)."""
    skeleton = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert not re.search(r"\s", re.sub(r"[,:] ", "", skeleton)), text


# ---- compile cache and keys ------------------------------------------------------------------

def test_grammar_key_is_canonical_and_checks_types():
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert grammar_key({"schema_type": "json", "schema": schema}) == grammar_key(
        {"schema_type": "json", "schema": json.dumps(schema, indent=4)})
    assert grammar_key({"schema_type": "json", "schema": schema})[1].index('"b"') < \
        grammar_key({"schema_type": "json", "schema": schema})[1].index('"a"')  # order kept
    assert grammar_key({"schema_type": "json_object", "schema": None}) == ("json_object", "")
    with pytest.raises(GrammarError, match="not valid JSON"):
        grammar_key({"schema_type": "json", "schema": "{nope"})
    with pytest.raises(GrammarError, match="non-empty string"):
        grammar_key({"schema_type": "regex", "schema": 5})
    longest = "a" * MAX_SCHEMA_CHARS
    assert grammar_key({"schema_type": "regex", "schema": longest}) == ("regex", longest)
    with pytest.raises(GrammarError, match=f"65537 characters; the limit is {MAX_SCHEMA_CHARS}"):
        grammar_key({"schema_type": "regex", "schema": longest + "a"})


@pytest.mark.parametrize("so_args, message", [
    ({"schema_type": "json", "schema": {"type": "foo"}},
     "not a valid JSON schema: \"foo\" is not valid under any of the given schemas"),
    # invalid per the metaschema, or a const / enum value the rest of its schema refuses: the
    # offline path (LLM) refuses what the server does (XGrammar compiled each)
    ({"schema_type": "json", "schema": {"anyOf": []}}, r"\[\] should be non-empty at #/anyOf"),
    ({"schema_type": "json", "schema": {"type": "object", "properties": {
        "n": {"type": "integer", "enum": [1, "two"]}}}},
     "the 'enum' value \"two\" at #/properties/n fails the rest of its schema"),
    ({"schema_type": "json", "schema": {"$ref": "#/$defs/missing"}}, "JSON schema: Cannot find"),
    ({"schema_type": "regex", "schema": "a(b"}, "regex: Regex parsing error at position 4: The parenthesis"),
    ({"schema_type": "ebnf", "schema": "root ::= foo"}, 'EBNF grammar: .*Rule "foo" is not'),
    # keywords XGrammar would silently ignore (outputs then violated the schema): refused
    ({"schema_type": "json", "schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
     "'allOf' with 2 subschemas at #"),
    ({"schema_type": "json", "schema": {"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}}, "keyword 'not' at #/properties/a"),
    ({"schema_type": "json", "schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"schema_type": "json", "schema": {"$ref": "http://example.com/s.json"}},
     "points outside the schema"),
    ({"schema_type": "json", "schema": {"type": "object", "properties": {}, "required": ["b"],
                                        "additionalProperties": False}}, r"requires \['b'\]"),
    ({"schema_type": "json", "schema": "false"}, "allows no value"),
    # accepted by XGrammar but not enforced (black-box testing: outputs violated each)
    ({"schema_type": "json", "schema": {"type": "integer", "multipleOf": 7}},
     "keyword 'multipleOf' at #"),
    ({"schema_type": "json", "schema": {"type": "array", "contains": {"const": 5}}},
     "keyword 'contains' at #"),
    ({"schema_type": "json", "schema": {"oneOf": [{"type": "integer", "maximum": 10},
                                                  {"type": "integer", "minimum": 5}]}},
     "'oneOf' at # is generated as 'anyOf'"),
    ({"schema_type": "json", "schema": {"type": "string", "pattern": "^[a-z]+$",
                                        "maxLength": 3}}, r"'maxLength' together with"),
    ({"schema_type": "json", "schema": {"type": "string", "format": "date", "maxLength": 4}},
     r"'maxLength' together with 'format'"),
    ({"schema_type": "json", "schema": {"enum": ["xa", "xyz"], "pattern": "^x"}},
     r"'pattern' next to 'enum'"),
    ({"schema_type": "json", "schema": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{3}$"}},
     "lookahead or lookbehind"),
    ({"schema_type": "regex", "schema": "a(?!b)[a-z]"}, "lookahead or lookbehind"),
    ({"schema_type": "json", "schema": {"type": "object", "additionalProperties": {
        "type": "integer"}, "minProperties": 3}}, "generated keys may repeat"),
    ({"schema_type": "json", "schema": {"type": "object", "patternProperties": {
        "^[a-c]$": {"type": "boolean"}}, "maxProperties": 2}}, "generated keys may repeat"),
    ({"schema_type": "json", "schema": {"type": "object", "minProperties": 2}},
     "'minProperties': 2 at #, but the object names 0"),
    # compiles, but no token can start it (found by black-box testing: a 200 of forbidden
    # tokens)
    ({"schema_type": "regex", "schema": "[^\\x00-\\U0010FFFF]"}, "matches no string"),
    ({"schema_type": "ebnf", "schema": "root ::= [^\\x00-\\U0010FFFF]"}, "matches no string"),
])
def test_invalid_constraint_is_a_clear_value_error(llm, so_args, message):
    """Under the XGrammar backend (under "auto" several of these go to LLGuidance)."""
    params = SamplingParams(max_tokens=8, so_args={**so_args, "backend": "xgrammar"})
    with pytest.raises(ValueError, match=message):
        llm.engine_core.make_request(PROMPT, params)
    assert not llm.engine_core.has_unfinished_requests()


def test_ecma_patterns_pass_the_validity_check():
    """The metaschema's `pattern` format is not checked with Python's `re` (it refused
    ECMA-262 patterns the backends take); a bad pattern is left to the backend to name."""
    check_valid({"type": "string", "pattern": r"^\p{L}+$", "enum": ["é"]})
    check_valid({"type": "string", "pattern": r"^(?<year>\d{4})$"})
    check_valid({"type": "string", "pattern": "(unclosed"})


def test_const_outside_its_enum_and_deep_nesting_are_refused():
    """A const its own enum excludes (XGrammar generated the const), and a schema nested past
    Python's recursion limit (a RecursionError was a 500 on the tools path): GrammarError."""
    with pytest.raises(GrammarError, match=r"'const' value 5 at # fails the rest of its schema "
                                           r"\(5 is not one of \[6\]\)"):
        check_valid({"const": 5, "enum": [6]})
    check_valid({"const": "a", "enum": ["a"]})
    deep = {"type": "string"}
    for _ in range(sys.getrecursionlimit()):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="nests too deeply to check.*'\\$defs'"):
        check_valid(deep)


def test_validity_verdicts_are_cached_by_the_schemas_json(monkeypatch):
    """A schema checked before is not checked again (a first check of a large schema took
    0.49 s), whatever the order of its keys; a refusal is cached with its message."""
    from deepinfer.engine.structured import validity

    checked = []
    real = validity._problem
    monkeypatch.setattr(validity, "_problem", lambda schema: checked.append(schema)
                        or real(schema))
    fresh = f"cache-{time.monotonic_ns()}"      # a schema no other test checked
    valid = {"type": "object", "description": fresh, "properties": {"a": {"type": "integer"}}}
    check_valid(valid)
    check_valid({"properties": {"a": {"type": "integer"}}, "description": fresh,
                 "type": "object"})
    assert checked == [valid]
    invalid = {"type": "string", "description": fresh, "enum": ["a", None]}
    messages = []
    for _ in range(2):
        with pytest.raises(GrammarError) as refused:
            check_valid(invalid)
        messages.append(str(refused.value))
    assert checked == [valid, invalid]
    assert messages[0] == messages[1]
    # the values a client sent spelled as JSON, not as Python (None, True, 'a')
    assert "(null is not of type \"string\")" in messages[0], messages[0]


@pytest.mark.parametrize("url", [*SUPPORTED_METASCHEMAS, "http://json-schema.org/draft-07/schema#"])
def test_known_metaschema_urls_are_accepted(url):
    check_valid({"$schema": url, "type": "object"})


@pytest.mark.parametrize("url", ["http://example.com/not-a-metaschema", "", 5,
                                 "https://json-schema.org/draft/2030-01/schema"])
def test_an_unknown_metaschema_url_is_refused(url):
    """`jsonschema` reads an unknown `$schema` as the latest draft, with a warning that this
    "will raise an error in the future"; the refusal lists the URLs it knows."""
    with pytest.raises(GrammarError) as refused:
        check_valid({"$schema": url, "type": "object"})
    message = str(refused.value)
    assert message.startswith(f"'$schema': {json.dumps(url)} at # is not the URL of a JSON "
                              "Schema meta-schema"), message
    for known in ('"http://json-schema.org/draft-07/schema"',
                  '"https://json-schema.org/draft/2019-09/schema"',
                  '"https://json-schema.org/draft/2020-12/schema"'):
        assert known in message


def test_enforceable_schemas_pass_the_keyword_check():
    from deepinfer.engine.structured.enforceable import check_enforceable

    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {
        "type": "integer"}}, "required": ["kind"]}
    dog = {"type": "object", "properties": {"kind": {"enum": ["dog"]}}, "required": ["kind"]}
    for schema in [{"allOf": [{"type": "integer"}]}, {"$ref": "#/$defs/a", "$defs": {"a": {}}},
                   {"type": "array", "uniqueItems": False},
                   {"type": "object", "properties": {"not": {"type": "string"}},
                    "required": ["not"], "additionalProperties": False},
                   # oneOf whose branches provably exclude each other: distinct types,
                   # disjoint constants, a discriminating required property (through $ref)
                   {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer"},
                              {"type": "null"}]},
                   {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
                   {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
                    "$defs": {"cat": cat, "dog": dog}},
                   {"type": "string", "pattern": "^[a-z]{1,3}$"}, {"enum": [1, 2], "type":
                                                                   "integer"},
                   {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1,
                    "maxProperties": 2}]:
        check_enforceable(schema)


def test_sampling_params_refuse_ignore_eos_and_min_tokens_with_so_args():
    so_args = {"schema_type": "json_object"}
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(so_args=so_args, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(so_args=so_args, min_tokens=3)


class CountingBackend:
    vocab_size = 64

    def __init__(self):
        self.compiled: list = []

    def compile(self, key):
        time.sleep(0.05)
        self.compiled.append(key)
        if key[1] == "bad":
            raise GrammarError("bad regex")
        return ("compiled", key)


def test_cache_compiles_each_constraint_once_across_threads_and_evicts_lru():
    backend = CountingBackend()
    manager = StructuredOutputManager({"xgrammar": lambda: backend}, max_cached_grammars=2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        manager.compile({"schema_type": "regex", "schema": "a+"}))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert backend.compiled == [("regex", "a+")]
    assert len(results) == 6 and all(r is results[0] for r in results)
    for _ in range(2):  # failures are cached too
        with pytest.raises(GrammarError, match="bad regex"):
            manager.compile({"schema_type": "regex", "schema": "bad"})
    assert backend.compiled.count(("regex", "bad")) == 1
    manager.compile({"schema_type": "regex", "schema": "b+"})   # evicts "a+" (least recent)
    manager.compile({"schema_type": "regex", "schema": "a+"})
    assert backend.compiled.count(("regex", "a+")) == 2


# ---- matcher and sampler -----------------------------------------------------------------------

def test_matcher_rollback_restores_the_bitmask(llm):
    manager = llm.engine_core.structured_output
    so_args = {"schema_type": "json", "schema": HAND_WRITTEN["integer_bounds"]}
    tokens = llm.tokenizer.encode('{"age": 42, "score": 3}', add_special_tokens=False)
    matcher = manager.new_matcher(so_args, [], llm.engine_core.eos_token_ids)
    masks = []
    for token_id in tokens:
        bitmask, _ = manager.fill_bitmask([matcher])
        masks.append(bitmask.clone())
        assert matcher.accept_token(token_id)
    matcher.rollback(3)
    bitmask, _ = manager.fill_bitmask([matcher])
    assert torch.equal(bitmask, masks[-3])
    for token_id in tokens[-3:]:
        assert matcher.accept_token(token_id)
    bitmask, _ = manager.fill_bitmask([matcher])
    allowed = [t for t in range(manager.backend.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == sorted(llm.engine_core.eos_token_ids)   # complete: only EOS may follow
    assert not matcher.accept_token(tokens[0])                # '{' no longer allowed
    assert matcher.accept_token(allowed[0]) and matcher.is_terminated()
    rebuilt = manager.new_matcher(so_args, tokens[:5], llm.engine_core.eos_token_ids)
    assert torch.equal(manager.fill_bitmask([rebuilt])[0], masks[5])


class State:
    def __init__(self, params, seed=7):
        self.sampling_params, self.seed = params, seed
        self.token_ids, self.num_prompt_tokens = [5, 6, 7], 3


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Reference: [B, W] int32 -> [B, V] bool (bit t % 32 of word t // 32)."""
    bits = (bitmask[:, :, None] >> torch.arange(32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.8, top_k=5, logprobs=3),
    SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.3, logprobs=3),
    SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.5, logprobs=3),
])
def test_sampler_picks_allowed_tokens_and_keeps_raw_logprobs(params):
    vocab, rows = 300, 6
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 4
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[:, 0] = 0b1000                       # token 3 always allowed
    grammar_rows = [0, 2, 3, 5]                  # rows 1 and 4 are free
    states = [State(params, seed=r) for r in range(rows)]
    plain = build_sampling_metadata(states, "cpu", eos_token_ids={0})
    masked = dataclasses.replace(plain, grammar_bitmask=bitmask, grammar_rows=grammar_rows)
    sampler = Sampler()
    free_out, out = sampler(logits, plain), sampler(logits.clone(), masked)
    allowed = unpack(bitmask, vocab)
    for row in range(rows):
        token = out.sampled_token_ids[row]
        if row in grammar_rows:
            assert allowed[row, token]
            if params.greedy:
                best = logits[row].masked_fill(~allowed[row], float("-inf")).argmax()
                assert token == int(best)
        else:
            assert token == free_out.sampled_token_ids[row]
        # logprobs are the model's raw distribution, mask or not
        raw = logits[row].log_softmax(-1)
        assert out.logprobs[row].logprob == pytest.approx(float(raw[token]), abs=1e-5)
        assert out.logprobs[row].top == free_out.logprobs[row].top


# ---- end to end on the tiny model -------------------------------------------------------------

def generate_and_validate(llm, named_schemas: dict[str, dict], seeds: int) -> list:
    params, names = [], []
    for name, schema in named_schemas.items():
        for seed in range(seeds):
            params.append(json_params(schema, seed))
            names.append(name)
    outputs = llm.generate([PROMPT] * len(params), params)
    for name, output in zip(names, outputs):
        if output.finish_reason == "stop":
            value = json.loads(output.text)
            jsonschema.validate(value, named_schemas[name])
            assert_compact(output.text)
    return outputs


def test_hand_written_schemas_validate(llm):
    outputs = generate_and_validate(llm, HAND_WRITTEN, seeds=3)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert len(stopped) >= 0.8 * len(outputs)
    texts = {o.text for o in stopped}
    assert len(texts) >= 0.8 * len(stopped)            # seeded sampling varies the outputs
    assert any("東京" in t or "Zürich" in t or "São Paulo" in t or "Ελλάδα" in t for t in texts)


def test_jsonschemabench_sample_validates(llm):
    corpus = {name: s for name, s in bench_sample(per_split=12).items() if is_exact(s)}
    compiled = {}
    for name, schema in corpus.items():
        try:
            llm.engine_core.structured_output.compile({"schema_type": "json", "schema": schema})
            compiled[name] = schema
        except GrammarError:
            pass                                       # unsupported: refused, never a crash
    assert len(compiled) >= 0.9 * len(corpus) and len(corpus) >= 40
    outputs = generate_and_validate(llm, compiled, seeds=1)
    assert sum(o.finish_reason == "stop" for o in outputs) >= 0.8 * len(outputs)


def test_json_object_outputs_are_objects(llm):
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=MAX_TOKENS,
                             so_args={"schema_type": "json_object"}) for s in range(6)]
    outputs = llm.generate([PROMPT] * 6, params)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert len(stopped) >= 4
    for output in stopped:
        assert isinstance(json.loads(output.text), dict)
        assert_compact(output.text)


def test_regex_outputs_fullmatch(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=40,
                             so_args={"schema_type": "regex", "schema": regex})
              for regex in REGEXES.values() for s in range(3)]
    outputs = llm.generate([PROMPT] * len(params), params)
    for output, regex in zip(outputs, [r for r in REGEXES.values() for _ in range(3)]):
        assert output.finish_reason == "stop"
        assert re.fullmatch(regex, output.text), (regex, output.text)


def test_ebnf_outputs_parse_as_arithmetic(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=60,
                             so_args={"schema_type": "ebnf", "schema": ARITHMETIC_EBNF})
              for s in range(8)]
    outputs = llm.generate([PROMPT] * 8, params)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert len(stopped) >= 6
    for output in stopped:
        tree = ast.parse(output.text, mode="eval")
        for node in ast.walk(tree):
            assert isinstance(node, (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant))
            if isinstance(node, ast.Constant):
                assert isinstance(node.value, int) and 1 <= node.value <= 999
        assert not re.search(r"\s", output.text)


def test_same_tokens_after_preemption_prefix_hits_and_for_n_choices(structured_llama_dir, llm):
    """Seeded choices of one request (as the server fans out n=4) give the same tokens alone, in
    a batch that is preempted (matchers rebuilt from the output so far), and with the prompt
    served from the prefix cache."""
    schema = HAND_WRITTEN["array_of_objects"]
    prompt = llm.tokenizer.encode("List a few items with their quantities as JSON. " * 4)
    params = [json_params(schema, seed) for seed in range(4)]
    alone = [llm.generate([prompt], p)[0].token_ids for p in params]
    assert len({tuple(t) for t in alone}) >= 3                     # the choices differ
    tight = make_llm(structured_llama_dir, num_blocks=52, block_size=4, caching=False)
    outputs = tight.generate([prompt] * 4, params)
    assert tight.engine_core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == alone
    again = llm.generate([prompt] * 4, params)                     # prompt blocks are cached
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == alone
    for output in outputs:
        if output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.text), schema)


def test_a_slow_compile_never_stalls_other_requests(tiny_llama_dir):
    """The compile of a new constraint runs in a worker thread: here it cannot finish until
    another request has streamed to its end, which would deadlock if it ran on the step loop."""
    from deepinfer.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(num_blocks=256)))
    other_done = threading.Event()
    backend = engine.engine_core.structured_output.backend
    compile_fast = backend.compile

    def compile_slow(key):
        assert other_done.wait(60), "the compile blocked the other request"
        return compile_fast(key)

    backend.compile = compile_slow
    slow = SamplingParams(temperature=0.0, max_tokens=12,
                          so_args={"schema_type": "regex", "schema": "[0-9]{3}-[a-z]{2}"})

    async def run_other():
        async for out in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                                ignore_eos=True)):
            final = out
        other_done.set()
        return final

    async def run_slow():
        async for out in engine.generate(PROMPT, slow):
            final = out
        return final

    async def main():
        return await asyncio.gather(run_slow(), run_other())

    try:
        slow_out, other_out = asyncio.run(main())
    finally:
        engine.shutdown()
    assert other_out.num_output_tokens == 8
    assert slow_out.finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", slow_out.text), slow_out.text


@pytest.mark.parametrize("backend", ["guidance", "auto"])
def test_issue_kinds_validate_end_to_end_and_a_cut_is_length(llm, backend):
    """The model generating under each kind issue 34 names (LLGuidance, or auto's pick): every
    output that stops validates (formats checked); one cut by max_tokens says "length"."""
    from structured_schemas import ISSUE_KINDS
    from test_structured_backends import format_checker

    names = list(ISSUE_KINDS)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=MAX_TOKENS,
                             so_args={"schema_type": "json", "schema": ISSUE_KINDS[name],
                                      "backend": backend})
              for name in names for seed in range(2)]
    outputs = llm.generate([PROMPT] * len(params), params)
    stopped = 0
    for i, output in enumerate(outputs):
        if output.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(output.text), ISSUE_KINDS[names[i // 2]],
                                format_checker=format_checker())
            assert_compact(output.text)
    assert stopped >= 0.7 * len(outputs)
    cut = llm.generate([PROMPT], SamplingParams(
        temperature=0.0, max_tokens=3, so_args={"schema_type": "json", "backend": backend,
                                                "schema": ISSUE_KINDS["formats"]}))[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
