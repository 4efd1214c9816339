"""Decode rows with several query tokens (issue 25.3): one step scoring `[t0, d1, d2, d3]` for a
request gives the same ids and logits as four single-token steps feeding those tokens.

Scheduler + KV cache manager + model runner, on tiny random float32 models: a Llama (GQA) and
a DeepSeek-V3 (MLA latent cache, MoE). The step with drafts also holds a plain decode row and a
new request's prefill that starts from prefix-cache hits. Tolerance: float32 logits, atol 1e-5
(the same forward, batched differently).
"""

from __future__ import annotations

import pytest
import torch
from deepseek_configs import randomize_router_bias, tiny_deepseek_config
from test_llama_parity import _tiny_config

from deepinfer.engine.config import SchedulerConfig
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.loader import load_model
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_single_thread")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-5
VOCAB = 256


def save_tiny_model(kind: str, path) -> None:
    """A tiny random "llama" (GQA) or "deepseek" (V3: MLA, MoE, YaRN) checkpoint in `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        hf_model = AutoModelForCausalLM.from_config(_tiny_config("llama_gqa"))
    else:
        hf_model = AutoModelForCausalLM.from_config(
            tiny_deepseek_config("v3_qlora_noaux_tc_yarn", vocab_size=VOCAB))
        randomize_router_bias(hf_model.eval())
    hf_model.save_pretrained(path)


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path)
    return load_model(path, torch.float32, "cpu")


class Engine:
    """The step loop's three calls, with the logits each step sampled from."""

    def __init__(self, model, dtype=torch.float32, device="cpu", *, cuda_graphs=False):
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                                   self.manager)
        self.runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, torch.device(device), dtype,
                                  frozenset())
        if cuda_graphs:
            self.runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=256)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams | None = None):
        params = params or SamplingParams(temperature=0.0, max_tokens=64)
        self.scheduler.add_request(Request(request_id, list(prompt), params,
                                           max_total_tokens=len(prompt) + 64, seed=7))

    def step(self, drafts: dict[str, list[int]] | None = None):
        """One step; returns (scheduler output, request id -> committed ids, StepLogits)."""
        if drafts:
            self.scheduler.update_draft_token_ids(drafts)
        out = self.scheduler.schedule()
        runner_out, logits = self.runner.execute_and_score(out)
        self.scheduler.update_from_output(out, runner_out)
        return out, dict(zip(runner_out.req_ids, runner_out.sampled_token_ids)), logits

    def request(self, request_id: str) -> Request:
        return self.scheduler.requests[request_id]


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


PROMPT_A = _prompt(10, 1)                 # 2 full blocks + 2 tokens
PROMPT_B = PROMPT_A[:8] + _prompt(5, 2)   # its first 2 blocks hit A's
PROMPT_C = _prompt(7, 3)


def _reference(new_engine, request_id: str, prompt: list[int], num_steps: int,
               params: SamplingParams | None = None):
    """One token per step, alone, in `new_engine()`: (sampled ids, [num_steps, V] logits of
    each step)."""
    engine = new_engine()
    engine.add(request_id, prompt, params)
    ids, rows = [], []
    for _ in range(num_steps):
        _, sampled, logits = engine.step()
        ids += sampled[request_id]
        rows.append(logits.of(request_id)[0])
    return ids, torch.stack(rows)


def assert_same_ids(got: list[int], ref_ids: list[int], ref_logits: torch.Tensor,
                    tie_margin: float) -> None:
    """got == ref_ids; where reduced precision may flip a near tie (the reference's top two
    logits within tie_margin), the test is skipped from the first such difference, since the
    rest depends on it. tie_margin 0: exact."""
    assert len(got) == len(ref_ids), (got, ref_ids)
    for position, (mine, theirs) in enumerate(zip(got, ref_ids)):
        if mine != theirs:
            top2 = ref_logits[position].float().topk(2).values
            assert float(top2[0] - top2[1]) < tie_margin, (position, got, ref_ids)
            pytest.skip(f"near tie at position {position}: {got} vs {ref_ids}")


def _last_logits(new_engine, tokens: list[int]) -> torch.Tensor:
    """[V] logits after `tokens`, from a fresh cache (one prefill)."""
    engine = new_engine()
    engine.add("x", tokens)
    return engine.step()[2].of("x")[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=64),
    SamplingParams(temperature=0.9, top_k=40, max_tokens=64, seed=11),
    # penalties at draft position j count the drafts before j as generated
    SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=3.0,
                   frequency_penalty=2.0)],
    ids=["greedy", "seeded", "penalized"])
def test_accepted_drafts_score_as_single_token_steps_beside_prefill_and_decode_rows(
        tiny_model, params):
    check_accepted_drafts(lambda: Engine(tiny_model), params, atol=ATOL)


def check_accepted_drafts(new_engine, params: SamplingParams, atol: float,
                          tie_margin: float = 0.0) -> None:
    """Score 3 drafts (the target's own tokens) for a, beside c's decode and b's prefill from
    prefix-cache hits: ids as single-token steps, logits within atol; then decode on."""
    ref_a, ref_a_logits = _reference(new_engine, "a", PROMPT_A, 9, params)
    _, ref_b_logits = _reference(new_engine, "b", PROMPT_B, 1)
    ref_c, ref_c_logits = _reference(new_engine, "c", PROMPT_C, 3)

    engine = new_engine()
    engine.add("a", PROMPT_A, params)
    engine.add("c", PROMPT_C)
    _, sampled, _ = engine.step()                          # prefill a and c
    assert_same_ids(sampled["a"], ref_a[:1], ref_a_logits[:1], tie_margin)
    engine.add("b", PROMPT_B)
    drafts = ref_a[1:4]                                    # the target's own next tokens
    out, sampled, logits = engine.step({"a": drafts})
    assert out.scheduled_spec_decode_tokens == {"a": drafts}
    assert out.num_scheduled_tokens == {"a": 4, "c": 1, "b": 5}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8     # prefix-cache hits
    assert_same_ids(sampled["a"], ref_a[1:5], ref_a_logits[1:5], tie_margin)  # all + bonus
    torch.testing.assert_close(logits.of("a"), ref_a_logits[1:5], atol=atol, rtol=0)
    torch.testing.assert_close(logits.of("b"), ref_b_logits, atol=atol, rtol=0)
    torch.testing.assert_close(logits.of("c"), ref_c_logits[1:2], atol=atol, rtol=0)
    assert_same_ids(sampled["c"], ref_c[1:2], ref_c_logits[1:2], tie_margin)
    assert engine.request("a").num_computed_tokens == len(PROMPT_A) + 4
    for _ in range(4):                                     # decoding goes on from the drafts' KV
        _, sampled, logits = engine.step()
    assert_same_ids(engine.request("a").output_token_ids, ref_a[:9], ref_a_logits, tie_margin)
    torch.testing.assert_close(logits.of("a"), ref_a_logits[8:9], atol=atol, rtol=0)


def test_rejected_drafts_roll_back_and_leave_block_accounting_exact(tiny_model):
    check_rejected_drafts(lambda: Engine(tiny_model), atol=ATOL)


def check_rejected_drafts(new_engine, atol: float, tie_margin: float = 0.0) -> None:
    """Score [t1, d1, wrong, 5] for a: d1 accepted, the rest rolled back; logits of every
    position within atol of single-token steps / fresh prefills; blocks, hashes and the free
    count as in plain decoding; decoding goes on as if no draft had been scored."""
    ref_a, ref_a_logits = _reference(new_engine, "a", PROMPT_A, 8)
    engine = new_engine()
    engine.add("a", PROMPT_A)
    assert_same_ids(engine.step()[1]["a"], ref_a[:1], ref_a_logits, tie_margin)
    wrong = (ref_a[2] + 1) % VOCAB
    drafts = [ref_a[1], wrong, 5]                          # d1 accepted, d2 rejected
    out, sampled, logits = engine.step({"a": drafts})
    assert out.num_scheduled_tokens == {"a": 4}
    assert_same_ids(sampled["a"], ref_a[1:3], ref_a_logits[1:3], tie_margin)  # d1, correction
    torch.testing.assert_close(logits.of("a")[:2], ref_a_logits[1:3], atol=atol, rtol=0)
    scored = PROMPT_A + ref_a[:2] + [wrong]                # rows after the rejection are still
    torch.testing.assert_close(logits.of("a")[2], _last_logits(new_engine, scored),   # scored
                               atol=atol, rtol=0)
    torch.testing.assert_close(logits.of("a")[3], _last_logits(new_engine, scored + [5]),
                               atol=atol, rtol=0)
    request = engine.request("a")
    assert request.num_computed_tokens == len(PROMPT_A) + 2    # two positions rolled back

    blocks = engine.manager.req_to_blocks["a"]
    assert len(blocks) == 3 and all(b.ref_cnt == 1 for b in blocks)   # the 4th block is free
    assert len(request.block_hashes) == 2                 # hashes of known tokens only
    assert [b.block_hash for b in blocks] == request.block_hashes + [None]

    # then the same blocks as one-token-at-a-time decoding to the same point
    twin = new_engine()
    twin.add("a", PROMPT_A)
    for _ in range(4):
        twin.step()
    out, _, _ = engine.step()
    assert out.scheduled_cached_reqs[0].num_kept_block_ids == 3   # the runner cuts its table
    assert engine.runner.requests["a"].block_ids == engine.manager.get_block_ids("a")
    twin_request = twin.request("a")
    assert_same_ids(request.output_token_ids, ref_a[:4], ref_a_logits, tie_margin)
    assert_same_ids(twin_request.output_token_ids, ref_a[:4], ref_a_logits, tie_margin)
    assert request.block_hashes == twin_request.block_hashes
    for manager, hashes in ((engine.manager, request.block_hashes),
                            (twin.manager, twin_request.block_hashes)):
        blocks = manager.req_to_blocks["a"]
        assert len(blocks) == 4 and all(b.ref_cnt == 1 for b in blocks)
        assert [b.block_hash for b in blocks] == hashes[:3] + [None]
    assert engine.manager.block_pool.num_free_blocks == twin.manager.block_pool.num_free_blocks
    assert (set(engine.manager.block_pool.cached_block_hash_to_block)
            == set(twin.manager.block_pool.cached_block_hash_to_block))

    # decoding goes on as if no draft had been scored
    for _ in range(4):
        _, _, logits = engine.step()
    assert_same_ids(engine.request("a").output_token_ids, ref_a, ref_a_logits, tie_margin)
    torch.testing.assert_close(logits.of("a"), ref_a_logits[7:8], atol=atol, rtol=0)
    engine.scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert engine.manager.block_pool.num_free_blocks == NUM_BLOCKS


def test_a_row_with_drafts_is_one_query_whose_every_position_gives_logits():
    import numpy as np

    from deepinfer.engine.input_batch import CachedRequestState, build_step_inputs

    def state(request_id, token_ids, num_computed, block_ids):
        return CachedRequestState(request_id, token_ids, 3, block_ids, num_computed,
                                  SamplingParams(), 0)

    prefill = state("p", [1, 2, 3, 4, 5], 0, [0, 1])
    verify = state("v", [10, 11, 12, 13, 14, 15, 16], 6, [2, 3, 4])
    chunk = state("c", list(range(20, 30)), 0, [5])
    inputs = build_step_inputs([prefill, verify, chunk], [5, 3, 4], BLOCK_SIZE,
                               torch.device("cpu"), draft_token_ids={"v": [100, 101]})
    assert inputs.input_ids.tolist() == [1, 2, 3, 4, 5, 16, 100, 101, 20, 21, 22, 23]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 0, 1, 2, 3]
    assert inputs.slot_mapping.tolist() == [0, 1, 2, 3, 4, 14, 15, 16, 20, 21, 22, 23]
    assert inputs.query_start_loc.tolist() == [0, 5, 8, 12]
    assert inputs.seq_lens.tolist() == [5, 9, 4]
    assert inputs.logits_indices.tolist() == [4, 5, 6, 7]
    assert inputs.sampling_states == [prefill, verify]
    assert inputs.draft_token_ids == [[], [100, 101]]
    plain = build_step_inputs([prefill, chunk], [5, 4], BLOCK_SIZE, torch.device("cpu"))
    assert plain.draft_token_ids is None and plain.logits_indices.tolist() == [4]
    assert np.array_equal(plain.input_ids, [1, 2, 3, 4, 5, 20, 21, 22, 23])
