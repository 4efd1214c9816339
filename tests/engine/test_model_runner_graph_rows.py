"""`ModelRunner` takes a replayed graph's logits and greedy ids only when the graph's rows are
exactly the rows that sample, i.e. every token of the step is a scored position
(engine/model_runner.py `_graph_rows_sample`; decode and verify graphs). Pure logic: no model,
no device."""

from types import SimpleNamespace

from deepinfer.engine.model_runner import ModelRunner


def _inputs(num_seqs: int, num_sampling: int):
    """A decode step's shape: one token per sequence, num_sampling of them sample."""
    import numpy as np

    return SimpleNamespace(num_seqs=num_seqs, sampling_states=[object()] * num_sampling,
                           input_ids=np.zeros(num_seqs, dtype=np.int64),
                           logits_indices=np.arange(num_sampling))


def test_graph_rows_are_used_when_every_sequence_samples():
    graph = SimpleNamespace(logits="graph logits", greedy_ids="graph ids")
    assert ModelRunner._graph_rows_sample(_inputs(4, 4), graph)


def test_verify_graph_rows_are_used_when_every_token_is_scored():
    """A verify step (rows of 1 + k tokens, engine/verify_graphs.py) scores all its tokens;
    one with a prompt chunk that does not sample at every token takes the LM head."""
    import numpy as np

    graph = SimpleNamespace(logits="graph logits", greedy_ids="graph ids")
    scored = SimpleNamespace(input_ids=np.zeros(9, dtype=np.int64), logits_indices=np.arange(9))
    assert ModelRunner._graph_rows_sample(scored, graph)
    partly = SimpleNamespace(input_ids=np.zeros(9, dtype=np.int64),
                             logits_indices=np.array([0, 1, 2, 8]))
    assert not ModelRunner._graph_rows_sample(partly, graph)


def test_a_mid_prompt_one_token_chunk_or_an_eager_step_uses_the_lm_head():
    graph = SimpleNamespace(logits="graph logits", greedy_ids="graph ids")
    assert not ModelRunner._graph_rows_sample(_inputs(4, 3), graph)   # one row does not sample
    assert not ModelRunner._graph_rows_sample(_inputs(4, 4), None)    # no graph replayed


def test_the_graph_logits_reach_the_sampler_as_float32_of_the_same_values():
    """The graph keeps the LM head's output in the model dtype (its greedy ids come from it);
    a sampling step gets it as float32: the same values, exactly."""
    import torch

    logits = (torch.randn(4, 50) * 4).to(torch.bfloat16)
    graph = SimpleNamespace(logits=logits, greedy_ids=logits.argmax(-1))
    runner = SimpleNamespace(_graph_rows_sample=ModelRunner._graph_rows_sample)
    got = ModelRunner._logits(runner, _inputs(4, 4), None, graph)
    assert got.dtype == torch.float32 and torch.equal(got, logits.float())
    assert torch.equal(got.argmax(-1), graph.greedy_ids)


def test_after_a_graph_replay_rows_that_do_not_all_sample_copy_only_the_indices():
    """A decode-shaped step with a mid-prompt 1-token chunk replays the graph, then runs the
    LM head over the sampling rows of its hidden states: only `logits_indices` goes to the
    device (the whole batch is copied only where the eager forward copied it already)."""
    import numpy as np
    import torch

    from deepinfer.engine.input_batch import StepInputs

    empty = np.zeros(0, dtype=np.int64)
    inputs = StepInputs(input_ids=empty, positions=empty, slot_mapping=empty,
                        query_start_loc=empty, seq_lens=np.ones(4, dtype=np.int64),
                        block_tables=np.zeros((4, 1), dtype=np.int32),
                        logits_indices=np.array([1, 3]), sampling_states=[object()] * 2,
                        device=torch.device("cpu"))
    hidden = torch.randn(4, 8)
    graph = SimpleNamespace(logits=None, greedy_ids=None)
    runner = SimpleNamespace(_graph_rows_sample=ModelRunner._graph_rows_sample,
                             model=SimpleNamespace(compute_logits=lambda rows: rows * 2))
    got = ModelRunner._logits(runner, inputs, hidden, graph)
    assert torch.equal(got, hidden[[1, 3]] * 2)
    assert inputs._device_inputs is None          # the batch was not copied


def test_a_greedy_step_commits_the_graphs_own_argmax_unless_asked_for_logits(monkeypatch):
    """`execute` (keep_logits False): a greedy step whose replayed graph scored exactly its
    sampled rows commits the graph's greedy ids, without float32 logits; `execute_and_score`
    (keep_logits) and a step that samples (temperature > 0) take the logits path. The graph's
    ids here differ from the logits' argmax on purpose, to tell the paths apart."""
    import functools

    import torch

    from deepinfer.engine.input_batch import CachedRequestState
    from deepinfer.engine.sampling_params import SamplingParams

    def state(request_id, temperature):
        return CachedRequestState(request_id, [5, 6, 7], 3, [0], 2,
                                  SamplingParams(temperature=temperature), 0)

    logits = torch.zeros(2, 16)
    logits[:, 3] = 1.0                                     # the logits' argmax: 3
    graph = SimpleNamespace(logits=logits, greedy_ids=torch.tensor([9, 11]))
    runner = SimpleNamespace(device=torch.device("cpu"), eos_token_ids=[2])
    for name in ("_commit", "_commit_drafts", "_logits", "_row_states"):
        setattr(runner, name, functools.partial(getattr(ModelRunner, name), runner))
    runner._graph_rows_sample = ModelRunner._graph_rows_sample
    runner._sample = lambda inputs, got: {s.request_id: ([int(got[i].argmax())], None)
                                          for i, s in enumerate(inputs.sampling_states)}
    from deepinfer.engine import model_runner
    built = []   # sampling metadata built by `_sample_step` itself (`_sample` builds its own)
    build = model_runner.build_sampling_metadata
    monkeypatch.setattr(model_runner, "build_sampling_metadata",
                        lambda *a, **k: built.append(1) or build(*a, **k))

    def step(temperature, keep_logits):
        inputs = _inputs(2, 2)
        inputs.sampling_states = [state("a", temperature), state("b", temperature)]
        inputs.draft_token_ids = None
        return ModelRunner._sample_step(runner, inputs, None, graph, keep_logits=keep_logits)

    sampled, got = step(0.0, keep_logits=False)
    assert sampled == {"a": ([9], None), "b": ([11], None)} and got is None
    sampled, got = step(0.0, keep_logits=True)   # the argmax of the logits it returns
    assert sampled == {"a": ([3], None), "b": ([3], None)} and torch.equal(got, logits)
    sampled, got = step(0.8, keep_logits=False)
    assert sampled["a"] == ([3], None) and got is not None
    assert not built   # the argmax check builds no metadata: `_sample` builds it once
