"""Several GPUs (NCCL): attention data parallelism + expert parallelism over 2, 4 and 8 ranks
(as many as are visible) give the greedy tokens of the plain one-GPU engine on the tiny random
DeepSeek-V3 (tests/engine/deepseek_configs.py: 8 routed experts + redundant replicas, noaux_tc
routing), float32 (TF32 is off by default in the ranks), across EPLB rebalances mid-generation
(the expert weights move between GPUs). Every rank agrees on the placement and the load counters
saw every routed token. Skipped below 2 GPUs; `bash benchmarks/gpu_suite.sh ep` runs it."""

import pytest
import torch
from test_deepseek_parity import save_tiny_deepseek
from tests.tiny_models import word_level_tokenizer
from test_expert_parallel import PROMPTS, _generate_on_core

from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs at least 2 CUDA devices")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BASE = dict(dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_v3_cuda(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v3-ep-gpu")
    tokenizer = word_level_tokenizer(512)   # the GPU machine has no SmolLM2 GGUF
    save_tiny_deepseek(path, "v3_qlora_noaux_tc_yarn", vocab_size=len(tokenizer),
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       num_nextn_predict_layers=0)
    tokenizer.save_pretrained(path)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        llm = LLM(str(path), **BASE)
        try:
            reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.engine_core.close()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return path, reference


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dp_ep_over_gpus_with_rebalances_matches_one_gpu(tiny_v3_cuda, ranks):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices, {torch.cuda.device_count()} visible")
    path, reference = tiny_v3_cuda
    # 8 experts + redundant slots split evenly over the ranks: 2 -> 10, 4 -> 12, 8 -> 16
    llm = LLM(str(path), **BASE, data_parallel_size=ranks, enable_expert_parallel=True,
              num_redundant_experts=ranks if ranks < 8 else 8, enable_eplb=True,
              eplb_interval_steps=4, eplb_window_steps=8, rank_timeout_s=120)
    core = llm.engine_core
    try:
        tokens, placed = _generate_on_core(core, PROMPTS, GREEDY)
        assert tokens == reference
        assert len(set(placed)) == min(ranks, len(PROMPTS))   # every rank got requests
        placements = core.executor.call("expert_placement")
        assert all(torch.equal(p, placements[0]) for p in placements)
        assert min(core.executor.call("num_rebalances")) >= 2
        initial = torch.arange(placements[0].shape[1]) % 8
        assert any(not torch.equal(layer, initial) for layer in placements[0])   # weights moved
    finally:
        core.close()
    assert not any(p.is_alive() for p in core.executor.processes)
