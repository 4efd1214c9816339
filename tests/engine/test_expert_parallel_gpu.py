"""One GPU, data_parallel_size=1 with the expert-parallel code path on (placement with
redundant replicas, device load counters, EPLB weight moves mid-generation): the tiny random
DeepSeek-V3 gives the tokens of the plain engine, float32 with TF32 off, greedy."""

import pytest
import torch
from test_deepseek_parity import save_tiny_deepseek
from tests.tiny_models import word_level_tokenizer

from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_ep_code_path_with_rebalances_matches_the_plain_engine_on_cuda(tmp_path):
    tokenizer = word_level_tokenizer(512)   # the GPU machine has no SmolLM2 GGUF
    save_tiny_deepseek(tmp_path, "v3_qlora_noaux_tc_yarn", vocab_size=len(tokenizer),
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       num_nextn_predict_layers=0)
    tokenizer.save_pretrained(tmp_path)
    prompts = [list(range(300 + 7 * n, 300 + 8 * n)) for n in (3, 11, 6, 17, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = dict(dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        outputs = {}
        for name, options in (("plain", {}), ("ep", dict(
                enable_expert_parallel=True, num_redundant_experts=4, enable_eplb=True,
                eplb_interval_steps=4, eplb_window_steps=8))):
            llm = LLM(str(tmp_path), **base, **options)
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if name == "ep":
                ep = llm.engine_core.executor.expert_parallel
                assert ep.num_rebalances >= 2
                assert ep.loads.window.device.type == "cuda"
            llm.engine_core.close()
        assert outputs["ep"] == outputs["plain"]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
