"""Verify steps replayed from CUDA graphs (engine/verify_graphs.py) against the same steps run
eagerly, on tiny random float32 models: a Llama (GQA, Triton varlen attention) and a DeepSeek-V3
(MLA absorbed decode kernel, MoE).

Two engines on the same weights take the same schedule: four requests (two greedy, two seeded),
then verify steps whose rows carry 0..5 drafts in a pattern that changes every step (varlen and
fixed-shaped steps, buckets of several sizes). Drafts are the plain-decoding continuation with
some positions corrupted, so steps accept, reject and roll back. One engine replays the verify
graphs, the other runs those steps eagerly: committed tokens must be equal at every step and the
scored logits within 1e-4 (float32; the same kernels, GEMMs of other row counts), and both must
end with plain decoding's tokens.
"""

import dataclasses

import pytest
import torch
from test_spec_decode_rows import VOCAB, Engine, _prompt, save_tiny_model

from deepinfer.engine.loader import load_model
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GAMMA = 5
ATOL = 1e-4
PROMPTS = {"g0": _prompt(9, 11), "g1": _prompt(14, 12), "s0": _prompt(6, 13), "s1": _prompt(11, 14)}
PARAMS = {"g0": SamplingParams(temperature=0.0, max_tokens=40),
          "g1": SamplingParams(temperature=0.0, max_tokens=40),
          "s0": SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=40),
          "s1": SamplingParams(temperature=0.7, seed=4, max_tokens=40)}


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def gpu_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"verify-{request.param}")
    save_tiny_model(request.param, path)
    model = load_model(path, torch.float32, "cuda")
    yield model
    del model
    torch.cuda.empty_cache()


def new_engine(model, device: str, verify_graphs: bool) -> Engine:
    engine = Engine(model, torch.float32, device)
    if device == "cuda":
        engine.runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=256,
                                          verify_query_len=1 + GAMMA if verify_graphs else 0,
                                          max_num_batched_tokens=256)
    for request_id, prompt in PROMPTS.items():
        engine.add(request_id, prompt, PARAMS[request_id])
    return engine


def run_with_drafts(engine: Engine, reference: dict[str, list[int]]):
    """Step `engine` to the end, each step with drafts from `reference` (the plain-decoding
    outputs) in a pattern of 0..GAMMA drafts per row that changes every step, one draft
    corrupted in some rows. Yields (drafts, committed ids, StepLogits) per step."""
    step = 0
    while engine.scheduler.num_unfinished_requests:
        drafts = {}
        for i, request_id in enumerate(sorted(PROMPTS)):
            request = engine.scheduler.requests.get(request_id)
            if request is None or request.num_computed_tokens != request.num_tokens - 1:
                continue
            done = len(request.output_token_ids)
            k = min((step + 2 * i) % (GAMMA + 1), PARAMS[request_id].max_tokens - done - 1)
            want = reference[request_id][done:done + k]
            if (step + i) % 3 == 1 and len(want) > 1:      # corrupt one draft: a rejection
                want[len(want) // 2] = (want[len(want) // 2] + 1) % VOCAB
            if want:
                drafts[request_id] = want
        _, sampled, logits = engine.step(drafts)
        yield drafts, sampled, logits
        step += 1


def drive(model, device: str, verify_graphs: bool, reference):
    engine = new_engine(model, device, verify_graphs)
    _, first, _ = engine.step()                                         # prefill all four
    outputs = {r: list(ids) for r, ids in first.items()}
    steps = [(None, first, None)]
    for drafts, sampled, logits in run_with_drafts(engine, reference):
        for request_id, ids in sampled.items():
            outputs.setdefault(request_id, []).extend(ids)
        if logits is not None:   # a replay's float32 logits are the graph's own buffer,
            logits = dataclasses.replace(logits, logits=logits.logits.clone())  # reused later
        steps.append((drafts, sampled, logits))
    return engine, outputs, steps


def reference_outputs(model, device: str) -> dict[str, list[int]]:
    engine = new_engine(model, device, verify_graphs=False)
    outputs: dict[str, list[int]] = {}
    while engine.scheduler.num_unfinished_requests:
        _, sampled, _ = engine.step()
        for request_id, ids in sampled.items():
            outputs.setdefault(request_id, []).extend(ids)
    return outputs


def check_replay_equals_eager(model, device: str) -> tuple[Engine, Engine]:
    reference = reference_outputs(model, device)
    graphed, graphed_out, graphed_steps = drive(model, device, True, reference)
    eager, eager_out, eager_steps = drive(model, device, False, reference)
    assert len(graphed_steps) == len(eager_steps)
    for (drafts, got, got_logits), (_, want, want_logits) in zip(graphed_steps, eager_steps):
        assert got == want, drafts
        if got_logits is not None and drafts:
            for request_id in drafts:
                torch.testing.assert_close(got_logits.of(request_id), want_logits.of(request_id),
                                           atol=ATOL, rtol=0)
    assert graphed_out == reference and eager_out == reference
    verify_steps = sum(1 for drafts, _, _ in graphed_steps if drafts)
    assert verify_steps >= 10
    accepted = sum(len(ids) - 1 for drafts, sampled, _ in graphed_steps if drafts
                   for r, ids in sampled.items() if r in drafts)
    assert accepted > 0
    return graphed, eager


def test_verify_replay_equals_eager_float32(gpu_model):
    graphed, eager = check_replay_equals_eager(gpu_model, "cuda")
    runner = graphed.runner
    assert runner.verify_graphs is not None and eager.runner.verify_graphs is None
    assert runner.verify_graphs.token_buckets[-1] == 8 * (1 + GAMMA)
    assert runner.verify_graphs.steps >= 10          # verify steps replayed, not run eagerly
    assert graphed.manager.block_pool.num_free_blocks == eager.manager.block_pool.num_free_blocks


def test_short_prompt_chunks_replay_equals_eager(gpu_model):
    """Prompts of 6-14 tokens prefill in one step of rows of up to 16 tokens: the chunk
    graphs replay it (and a later prompt that the prefix cache held all but its tail), with
    the same tokens as an engine without graphs and logits within 1e-4 (float32)."""
    graphed = Engine(gpu_model, torch.float32, "cuda", cuda_graphs=True)
    eager = Engine(gpu_model, torch.float32, "cuda")
    assert graphed.runner.chunk_graphs is not None
    outputs = []
    for engine in (graphed, eager):
        for request_id, prompt in PROMPTS.items():
            engine.add(request_id, prompt, PARAMS[request_id])
        _, first, logits = engine.step()
        steps = [(first, {r: logits.of(r).clone() for r in first})]
        engine.add("tail", PROMPTS["g1"] + [5, 6, 7], PARAMS["g0"])   # shares g1's blocks
        while engine.scheduler.num_unfinished_requests:
            _, sampled, _ = engine.step()
            steps.append((sampled, None))
        outputs.append(steps)
    (got_first, got_logits), (want_first, want_logits) = outputs[0][0], outputs[1][0]
    assert got_first == want_first
    for request_id in want_first:
        torch.testing.assert_close(got_logits[request_id], want_logits[request_id], atol=ATOL,
                                   rtol=0)
    assert [s for s, _ in outputs[0]] == [s for s, _ in outputs[1]]
    assert graphed.runner.chunk_graphs.steps >= 1 and eager.runner.chunk_graphs is None
