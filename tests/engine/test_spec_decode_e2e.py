"""Speculative decoding end to end (issue 30): greedy and seeded outputs (tokens and logprobs)
are the same with and without n-gram drafts, alone and in batches, varlen and fixed; abort and
preemption with drafts in flight leak no KV block.

SmolLM2 (the embedded default, float32 on CPU) on an input-grounded prompt, where n-gram drafts
are accepted; a tiny random Llama (tests/tiny_models.py) for preemption and abort.
"""

import dataclasses

import pytest

from deepinfer.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                     SpeculativeConfig)
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.step_rate import StepRateTable

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
    SamplingParams(temperature=0.8, seed=1234, max_tokens=24),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=7, max_tokens=24,
                   repetition_penalty=1.05, min_tokens=10, logprobs=1),
]


def make_llm(model_dir, spec: SpeculativeConfig | None = None, num_blocks=512, block_size=16,
             max_num_seqs=4, caching=True, budget=256) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        speculative=spec or SpeculativeConfig()))


def grounded_prompt(llm: LLM, instruction: str) -> str:
    messages = [{"role": "user", "content": f"{instruction}\n\n{CODE}"}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def same_outputs(expected, actual):
    for want, got in zip(expected, actual):
        assert got.token_ids == want.token_ids
        if want.logprobs is not None:
            assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in want.logprobs]
            assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs], abs=1e-4)   # a 1 + k row vs 1-token rows
            assert [[t for t, _ in lp.top] for lp in got.logprobs] == [
                [t for t, _ in lp.top] for lp in want.logprobs]


@pytest.fixture(scope="module")
def smollm2_runs(smollm2_dir):
    plain = make_llm(smollm2_dir)
    prompts = [grounded_prompt(plain, "Repeat this code exactly."),
               grounded_prompt(plain, "Copy the code below without changes."),
               grounded_prompt(plain, "Rewrite this code.")]
    expected = plain.generate(prompts, PARAMS)
    del plain
    spec = make_llm(smollm2_dir, SpeculativeConfig(speculative_method="ngram",
                                                   num_speculative_tokens=4))
    # varlen admission over fixed prices (drafts nearly free): whether a draft pays on this
    # box's measured step times is load-dependent (a full suite beside other jobs once
    # verified one draft, rejected, and no other); these tests are about the outputs
    spec.engine_core.spec.step_rate = StepRateTable({1: 0.010, 8: 0.020}, {1: 1e-6}, window=0)
    return prompts, expected, spec


def test_ngram_batch_outputs_equal_plain_decoding(smollm2_runs):
    prompts, expected, spec = smollm2_runs
    outputs = spec.generate(prompts, PARAMS)
    same_outputs(expected, outputs)
    stats = spec.engine_core.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0   # drafts were accepted
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[1]
    assert spec.engine_core.get_stats().spec_decode is stats


def test_ngram_alone_equals_plain_decoding(smollm2_runs):
    prompts, expected, spec = smollm2_runs
    same_outputs(expected[1:2], spec.generate(prompts[1:2], PARAMS[1:2]))


@pytest.mark.parametrize("varlen", [True, False])
def test_tiny_llama_with_preemption_and_abort_leaks_no_block(tiny_llama_dir, varlen):
    """40 blocks of 4 tokens cannot hold 6 requests at once: preemptions with drafts in
    flight; outputs equal plain decoding's; every block comes back, after aborts too."""
    prompts = [[7] * 9, list(range(100, 112)) * 2, [3, 4, 5] * 5, list(range(300, 321)),
               [42, 43] * 6, list(range(900, 930))]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)] * 3
    expected = make_llm(tiny_llama_dir, num_blocks=256, block_size=4,
                        caching=False).generate(prompts, params)
    spec_config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3,
                                    spec_varlen=varlen)
    llm = make_llm(tiny_llama_dir, spec_config, num_blocks=40, block_size=4, caching=False)
    if varlen:   # this test needs drafts in flight, not the admission's judgement of a tiny
        # model's step times (they decide whether any draft pays): drafts nearly free, fixed
        llm.engine_core.spec.step_rate = StepRateTable({1: 0.010, 8: 0.020}, {1: 1e-6},
                                                       window=0)
    pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
    same_outputs(expected, llm.generate(prompts, params))
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert llm.engine_core.spec.stats.num_draft_tokens > 0
    assert pool.num_free_blocks == 40
    # abort with drafts just verified and rolled back
    core = llm.engine_core
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(core.make_request(prompt, p, f"abort-{i}"))
    drafts_before = core.spec.stats.num_drafts
    for _ in range(40):
        core.step()
        if core.spec.stats.num_drafts > drafts_before + 3:
            break
    assert core.spec.stats.num_drafts > drafts_before
    core.abort_requests([f"abort-{i}" for i in range(len(prompts))])
    core.step()
    assert not core.has_unfinished_requests()
    assert pool.num_free_blocks == 40


def test_structured_outputs_with_drafts_equal_plain_decoding(tiny_llama_dir):
    """Each draft position is masked by the grammar after the drafts before it; drafts the
    grammar refuses are rejected; the matcher rolls back. Outputs (greedy and seeded) equal
    plain decoding's and match the grammar."""
    import re

    pattern = r"(ab|cd)( (ab|cd)){10}"
    prompts = [[5, 6, 7] * 4, list(range(200, 230)), [9] * 12]
    params = [SamplingParams(temperature=0.0, max_tokens=40,
                             so_args={"schema_type": "regex", "schema": pattern,
                                      "backend": "xgrammar"}),
              SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                             so_args={"schema_type": "regex", "schema": pattern,
                                      "backend": "guidance"}),
              SamplingParams(temperature=0.0, max_tokens=24,
                             so_args={"schema_type": "json_object", "backend": "guidance"})]
    expected = make_llm(tiny_llama_dir, block_size=4).generate(prompts, params)
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(speculative_method="ngram",
                                                     num_speculative_tokens=4,
                                                     spec_varlen=False), block_size=4)
    outputs = llm.generate(prompts, params)
    same_outputs(expected, outputs)
    for out in outputs[:2]:   # (the tiny random model's first tokens may decode to no text)
        assert re.search(pattern + "$", out.text), out.text
    assert llm.engine_core.spec.stats.num_accepted_tokens > 0


def chi_square_pvalue_even_df(observed, expected) -> float:
    """Pearson's chi-square test; the survival function for even df = 2m is
    exp(-x/2) * sum_{i<m} (x/2)^i / i! (categories - 1 must be even)."""
    import math

    df = len(observed) - 1
    assert df % 2 == 0
    x = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))


def test_unseeded_sampling_with_drafts_keeps_the_model_distribution(tiny_llama_dir):
    """N unseeded requests sample (t1, t2) at temperature 1 among the top 3 tokens; after the
    prefill step each gets drafts [likeliest t2 given t1, anything], so t2 comes out of a verify
    row. The 9 (t1, t2) pair counts must follow the model's exact pair probabilities (from its
    logprobs): chi-square, df 8, significance 1e-3 (false alarm < 1e-3; random seeds, so the
    test may fail spuriously once in a thousand runs)."""
    import math

    prompt, n = [11, 12, 13, 14, 15, 16], 900
    llm = make_llm(tiny_llama_dir, num_blocks=4096, block_size=4, max_num_seqs=n,
                   budget=len(prompt) * n)
    core = llm.engine_core

    def top3(tokens):   # [(token, prob)] of the top 3 renormalised (temperature 1, top_k 3)
        out = llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1,
                                                    logprobs=3))[0]
        top = out.logprobs[0].top
        total = sum(math.exp(lp) for _, lp in top)
        return [(t, math.exp(lp) / total) for t, lp in top]

    first = top3(prompt)
    second = {t1: top3(prompt + [t1]) for t1, _ in first}
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    for i in range(n):
        core.add_request(core.make_request(prompt, params, f"u{i}"))
    core.step()                                  # prefill: t1 of every request
    requests = core.scheduler.requests
    core.scheduler.update_draft_token_ids({
        rid: [second[r.output_token_ids[0]][0][0], 3] for rid, r in requests.items()})
    verified = core.step()   # rows that reached 3+ tokens accepted their first draft
    assert sum(out.num_output_tokens >= 3 for out in verified) > n // 5
    outputs = {out.request_id: tuple(out.token_ids[:2]) for out in verified if out.finished}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                outputs[out.request_id] = tuple(out.token_ids[:2])
    assert len(outputs) == n
    pairs = [(t1, t2) for t1, _ in first for t2, _ in second[t1]]
    probs = {(t1, t2): p1 * p2 for t1, p1 in first for t2, p2 in second[t1]}
    counts = [sum(o == pair for o in outputs.values()) for pair in pairs]
    assert sum(counts) == n
    assert chi_square_pvalue_even_df(counts, [probs[p] * n for p in pairs]) > 1e-3


class OracleDrafter:
    """Drafts the plain run's next tokens (then one wrong token) with confidence 0.9: drafts
    that are accepted, whatever this random model generates (tests only)."""

    def __init__(self, prompts, expected):
        self.continuations = [(list(p), list(o.outputs[0].token_ids))
                              for p, o in zip(prompts, expected)]

    def propose(self, requests):
        from deepinfer.engine.spec.drafter import DraftProposal

        proposals = {}
        for request in requests:
            prompt = list(request.token_ids[:request.num_prompt_tokens])
            done = len(request.token_ids) - request.num_prompt_tokens
            output = next(o for p, o in self.continuations if p == prompt)
            drafts = (output[done:] + [0] * request.max_drafts)[:request.max_drafts]
            proposals[request.request_id] = DraftProposal(drafts, [0.9] * len(drafts))
        return proposals

    def observe(self, request_id, num_verified, num_accepted):
        pass

    def forget(self, request_id):
        pass


def async_ngram_llm(model_dir) -> LLM:
    """The tiny Llama with async scheduling forced on (as on CUDA) and varlen n-gram drafts."""
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                  async_scheduling=True),
        speculative=SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4)))


def test_varlen_keeps_async_scheduling_for_steps_that_carry_no_drafts(tiny_llama_dir):
    """Async scheduling stays on with varlen speculation: a step at a batch where no draft can
    pay is launched without waiting for the one in flight, a step that may carry drafts waits
    (its rows' last tokens must be known), and no step is both. Greedy and seeded tokens equal
    plain synchronous decoding, drafts were accepted, and every KV block is free at the end."""

    prompts = [list(range(100 + 9 * n, 130 + 9 * n)) for n in range(6)]
    params = [SamplingParams(temperature=0.0 if n % 2 else 0.8, seed=n, max_tokens=6 + 7 * n,
                             ignore_eos=True) for n in range(6)]
    expected = make_llm(tiny_llama_dir, block_size=4).generate(prompts, params)
    llm = async_ngram_llm(tiny_llama_dir)
    core = llm.engine_core
    assert core.async_scheduling
    core.spec.drafter = OracleDrafter(prompts, expected)
    # up to 2 drafts cost nothing over the plain step, more never pay: they never run, so are
    # never re-measured (no exploration). Each batch size's overlapped plain step is
    # measured before drafting there (async_plain_steps): those steps run asynchronously.
    core.spec.step_rate = StepRateTable({1: 0.010, 8: 0.020}, {1: 1e-6, 2: 1e-6, 3: 1000.0})
    core.spec.config = dataclasses.replace(core.spec.config, spec_explore_fraction=0.0)
    assert core.spec.async_plain_steps
    launches = []
    execute = core.executor.execute

    def spy(scheduler_output, non_block=False):
        launches.append((non_block, bool(scheduler_output.scheduled_spec_decode_tokens)))
        return execute(scheduler_output, non_block=non_block)

    core.executor.execute = spy
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in expected]
    assert any(non_block for non_block, _ in launches)
    assert any(drafts for _, drafts in launches)
    assert not any(non_block and drafts for non_block, drafts in launches)
    assert core.spec.stats.num_accepted_tokens > 0
    pool = core.scheduler.kv_cache_manager.block_pool
    assert not core.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks


def timed_oracle_llm(tiny_llama_dir, prompts, params, monkeypatch):
    """(async varlen n-gram LLM drafting the plain run's tokens, whose drafts up to 4 cost
    nothing; the plain run's outputs; the (verified, seconds) of each timed step, filled as it
    runs)."""
    expected = make_llm(tiny_llama_dir, block_size=4).generate(prompts, params)
    llm = async_ngram_llm(tiny_llama_dir)
    spec = llm.engine_core.spec
    spec.drafter = OracleDrafter(prompts, expected)
    spec.step_rate = StepRateTable({1: 0.010, 8: 0.020}, {1: 1e-6, 4: 1e-6})
    timed, observe_time = [], spec.observe_time

    def spy(scheduler_output, seconds, **options):
        timed.append((bool(scheduler_output.scheduled_spec_decode_tokens), seconds))
        observe_time(scheduler_output, seconds, **options)

    monkeypatch.setattr(spec, "observe_time", spy)
    return llm, expected, timed


def test_a_blocking_step_is_timed_by_its_own_loop_iteration(tiny_llama_dir, monkeypatch):
    """Where plain steps overlap the host, a verify step (or a look) is priced by the loop
    iteration that ran it, drafter, admission and commit included, and by nothing after it:
    the idle time before the next `generate` is not charged to the last step of the one
    before (an engine that did so priced every verify step out and stopped drafting)."""
    import time

    prompts = [list(range(100 + 9 * n, 130 + 9 * n)) for n in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm, expected, timed = timed_oracle_llm(tiny_llama_dir, prompts, params, monkeypatch)
    outputs = [llm.generate([prompt], params)[0] for prompt in prompts[:1]]
    time.sleep(0.5)
    outputs += llm.generate(prompts[1:], params)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in expected]
    assert any(verified for verified, _ in timed)
    assert max(seconds for _, seconds in timed) < 0.5


def test_a_blocking_step_that_drains_an_overlapped_step_pays_for_the_drain(tiny_llama_dir,
                                                                           monkeypatch):
    """Committing a step takes 40 ms here (a slow output processor). Between overlapped plain
    steps that commit runs while the next step computes; a verify step after a plain step
    first waits for it and commits it with nothing in flight. Its time starts where the
    plain step's period (as measured, ~40 ms) would have ended, not at its own iteration:
    ~80 ms (the drained commit and its own) instead of ~40."""
    import time

    prompts = [list(range(100, 130))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm, expected, timed = timed_oracle_llm(tiny_llama_dir, prompts, params, monkeypatch)
    processor = llm.engine_core.output_processor
    process = processor.process

    def slow_process(*args, **kwargs):
        time.sleep(0.040)
        return process(*args, **kwargs)

    monkeypatch.setattr(processor, "process", slow_process)
    [output] = llm.generate(prompts, params)
    assert output.outputs[0].token_ids == expected[0].outputs[0].token_ids
    first_verify = next(seconds for verified, seconds in timed if verified)
    assert first_verify > 0.070


@pytest.fixture(scope="module")
def smollm2_fixed_and_plain(smollm2_dir):
    """(SmolLM2 with fixed-length n-gram drafts (5 every step), SmolLM2 without)."""
    spec = make_llm(smollm2_dir, SpeculativeConfig(speculative_method="ngram",
                                                   num_speculative_tokens=5,
                                                   spec_varlen=False))
    return spec, make_llm(smollm2_dir)


def test_drafts_past_the_grammars_end_are_left_unmasked(smollm2_fixed_and_plain):
    """A prompt the answer repeats: the n-gram drafts copy the choice, then the chat
    template's end-of-turn token (which completes the grammar) and the tokens after it. The
    positions after the grammar's end get no mask (the matcher has terminated; nothing after
    the end-of-turn token is committed); the output is the plain one."""
    spec, plain = smollm2_fixed_and_plain
    text = "the quick brown fox jumps over the lazy dog"
    messages = [{"role": "user", "content": text}]
    prompt = spec.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, so_args={
        "schema_type": "regex", "schema": f"({text}|no)", "backend": "xgrammar"})
    before = spec.engine_core.spec.stats.num_accepted_tokens
    [got] = spec.generate([prompt], [params])
    assert spec.engine_core.spec.stats.num_accepted_tokens > before
    [want] = plain.generate([prompt], [params])
    assert got.token_ids == want.token_ids and got.text in (text, "no")


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(smollm2_fixed_and_plain):
    """Drafts accepted past the token that completes a stop string are not output: token ids,
    logprobs and the token count equal plain decoding's (before, " e" gave 7 tokens for
    plain's 5, and "f g a" 13 for 8)."""
    spec, plain = smollm2_fixed_and_plain
    prompt = " ".join(["a b c d e f g"] * 4)   # continued by copying: drafts pass
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], logprobs=1)
              for stop in (" e", "f g a")]
    before = spec.engine_core.spec.stats.num_accepted_tokens
    got = spec.generate([prompt] * 2, params)
    assert spec.engine_core.spec.stats.num_accepted_tokens > before
    want = plain.generate([prompt] * 2, params)
    same_outputs(want, got)
    for g, w in zip(got, want):
        assert g.finish_reason == w.finish_reason == "stop" and g.text == w.text
        assert len(g.logprobs) == len(g.token_ids) == len(w.token_ids)
