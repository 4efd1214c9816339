"""KV store saves on CUDA (engine/kv_transfer.py: `KVBlockCopier` on the worker side,
`ModelRunner.start_read_kv_blocks`): the worker queues the copy of saved blocks behind the
launched step and returns without waiting for the device; the store's background loop waits
for the copy's event before encoding. Checked: the save (`KVBlockCopier.save`, then
`KVTransfer._send_saves`) returns while the step's kernels are still running, and what the
store holds is bit-equal to the blocks as the step left them; through the whole engine (async
steps), a prompt loaded back from the store gives the tokens of computing it."""

import gc
import time

import pytest
import torch

from deepinfer.engine.config import KVTransferConfig
from deepinfer.engine.kv_cache.spec import FullAttentionSpec, MLAAttentionSpec
from deepinfer.engine.kv_transfer import KVBlockCopier, KVTransfer
from deepinfer.engine.outputs import KVBlocks
from kv_runner_fake import FakeRunner
from deepinfer.kvstore import MemoryKVStore

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK = 4
SLEEP_CYCLES = 500_000_000  # torch.cuda._sleep: ~0.25 s at the H200's ~2 GHz clock


@pytest.mark.parametrize("layout", ["full", "mla"])
def test_save_returns_before_the_step_ends_and_stores_its_blocks(layout):
    spec, dtype = ((FullAttentionSpec(4, 2, 64, 2), torch.bfloat16) if layout == "full" else
                   (MLAAttentionSpec(4, kv_lora_rank=64, qk_rope_head_dim=16, dtype_bytes=2),
                    torch.bfloat16))
    store = MemoryKVStore()
    source = FakeRunner(spec, 16, dtype, seed=0, block_size=BLOCK, device="cuda")
    target = FakeRunner(spec, 16, dtype, seed=1, block_size=BLOCK, device="cuda")
    source_copier, target_copier = KVBlockCopier(source), KVBlockCopier(target)
    saver = KVTransfer(KVTransferConfig(), source_copier, b"\x02" * 8, BLOCK, store=store)
    loader = KVTransfer(KVTransferConfig(), target_copier, b"\x02" * 8, BLOCK, store=store)

    def save_blocks(saves):   # the worker starts the copy out, the core side sends it
        source_copier.save(saves)
        saver._send_saves(source_copier.take_kv_reads())
    axis = source.kv_block_dim
    # outside the timing: kernels, and pinned host blocks of the sizes the timed save takes
    # (the first allocation of a size, cudaHostAlloc, synchronizes the device)
    save_blocks([KVBlocks("warm", [1, 2], [98, 99])])
    saver.flush()
    torch.cuda.synchronize()

    # "the step": a long kernel, then new values written into blocks 3 and 5 of every layer
    # (made beforehand: nothing after the sleep may wait for the device)
    new_values = [(torch.randn_like(kv.select(axis, 3)), torch.randn_like(kv.select(axis, 5)))
                  for kv in source.kv_caches]
    torch.cuda._sleep(SLEEP_CYCLES)
    for kv, (block_3, block_5) in zip(source.kv_caches, new_values):
        kv.select(axis, 3).copy_(block_3)
        kv.select(axis, 5).copy_(block_5)
    step_done = torch.cuda.Event()
    step_done.record()
    started = time.monotonic()
    save_blocks([KVBlocks("a", [3, 5], [11, 12])])
    returned_s = time.monotonic() - started
    assert not step_done.query(), "the save waited for the step's kernels"
    assert returned_s < 0.05

    saver.flush(timeout_s=30)
    assert step_done.query()
    assert saver.get_stats().blocks_saved == 4
    blocks = loader._submit(loader._fetch([11, 12])).result()
    assert blocks.shape[0] == 2
    target_copier.stage_kv_blocks("b", [11, 12], blocks)
    target_copier.load([KVBlocks("b", [0, 7], [11, 12])])
    for src, dst in zip(source.kv_caches, target.kv_caches):
        assert torch.equal(src.select(axis, 3), dst.select(axis, 0))
        assert torch.equal(src.select(axis, 5), dst.select(axis, 7))
    for kv, (block_3, _) in zip(source.kv_caches, new_values):
        assert torch.equal(kv.select(axis, 3), block_3)  # the step's values were saved
    saver.close()
    loader.close()


def test_engine_tokens_from_the_store_equal_computed_ones(tmp_path):
    """Async steps on CUDA with the default `memory` store: prompts computed (their blocks
    saved behind the launched steps), then, with the local prefix cache emptied, loaded back
    from the store: the same greedy tokens, and the store served blocks."""
    from transformers import LlamaConfig

    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams
    from tests.engine.test_gpu_engine import write_random_llama_dir

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model_dir = write_random_llama_dir(tmp_path / "llama", config)
    engine_config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "float32"},
        cache={"num_blocks": 64, "block_size": 16},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
        kv_transfer={"kv_store": "memory"})
    llm = LLM(config=engine_config)
    core = llm.engine_core
    assert core.async_scheduling
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (37, 64, 90, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cold = [out.token_ids for out in llm.generate(prompts, params)]
    core.kv_transfer.flush(timeout_s=30)
    assert core.get_stats().kv_store.blocks_saved >= 2 + 4 + 5
    core.scheduler.kv_cache_manager.reset_prefix_cache()
    warm = [out.token_ids for out in llm.generate(prompts, params)]
    assert warm == cold
    assert core.get_stats().kv_store.hits > 0
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()
