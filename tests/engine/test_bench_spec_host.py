"""benchmarks/bench_spec_host.py runs end to end on a short workload: its model's greedy
decoding walks the cycle its prompts hold, so n-gram drafts are accepted in full (the
benchmark measures host cost per verify step of five accepted drafts), and every engine gives
the same tokens per step where it should. CPU, tiny model."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spec_host.py"


def test_bench_spec_host_accepts_every_draft_on_its_cycle(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_spec_host", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "NEW_TOKENS", 24)
    results = bench.main(["--repeats", "1"])
    assert set(results) == {f"{e} b={b}" for e in ("off", "fixed", "varlen") for b in (1, 16)}
    assert results["off b=1"]["tokens_per_step"] == 1.0
    assert results["off b=1"]["spec_host_ms_per_step"] == 0.0
    # 24 tokens: steps of 1 + 5 tokens while the budget lasts -> 4 tokens a step or more
    assert results["fixed b=1"]["tokens_per_step"] >= 4.0
    assert results["fixed b=16"]["tokens_per_step"] >= 16 * 4.0
    assert results["fixed b=16"]["spec_host_ms_per_step"] > 0.0
