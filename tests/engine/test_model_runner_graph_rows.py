"""`ModelRunner` takes a replayed graph's logits and greedy ids only when the graph's rows are
exactly the rows that sample (engine/model_runner.py `_graph_rows_sample`). Pure logic: no
model, no device."""

from types import SimpleNamespace

from engine.model_runner import ModelRunner


def _inputs(num_seqs: int, num_sampling: int):
    metadata = SimpleNamespace(num_seqs=num_seqs)
    return SimpleNamespace(attn_metadata=metadata, sampling_states=[object()] * num_sampling)


def test_graph_rows_are_used_when_every_sequence_samples():
    graph = SimpleNamespace(logits="graph logits", greedy_ids="graph ids")
    assert ModelRunner._graph_rows_sample(_inputs(4, 4), graph)


def test_a_mid_prompt_one_token_chunk_or_an_eager_step_uses_the_lm_head():
    graph = SimpleNamespace(logits="graph logits", greedy_ids="graph ids")
    assert not ModelRunner._graph_rows_sample(_inputs(4, 3), graph)   # one row does not sample
    assert not ModelRunner._graph_rows_sample(_inputs(4, 4), None)    # no graph replayed
