"""KV cache layouts from numbers alone (no torch): bytes per token and per block, tensor shapes,
and the block count a memory budget buys; the scheduler only ever sees that count."""

from deepinfer.engine.kv_cache.spec import FullAttentionSpec, MLAAttentionSpec, num_blocks_for_budget


def test_full_attention_spec_counts_k_and_v_per_kv_head():
    spec = FullAttentionSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)
    assert spec.kv_cache_shape(100, 16) == (2, 100, 16, 3, 64)
    assert spec.bytes_per_token() == 2 * 30 * 3 * 64 * 4
    assert spec.block_bytes(16) == 16 * spec.bytes_per_token()


def test_mla_spec_is_one_latent_vector_per_token_and_layer():
    # DeepSeek-V3: 61 layers + 1 MTP layer, kv_lora_rank 512, qk_rope_head_dim 64, bf16
    spec = MLAAttentionSpec(num_layers=62, kv_lora_rank=512, qk_rope_head_dim=64, dtype_bytes=2)
    assert spec.latent_dim == 576
    assert spec.kv_cache_shape(10, 64) == (10, 64, 576)
    assert spec.bytes_per_token() == 62 * 576 * 2
    # the same model with per-head K (192) and V (128) for 128 heads would take 71x more
    mha = 62 * 128 * (192 + 128) * 2
    assert mha // spec.bytes_per_token() == 71


def test_budget_buys_blocks_by_bytes_whatever_the_layout():
    mla = MLAAttentionSpec(num_layers=3, kv_lora_rank=32, qk_rope_head_dim=16, dtype_bytes=4)
    full = FullAttentionSpec(num_layers=3, num_kv_heads=4, head_dim=32, dtype_bytes=4)
    budget = 1 << 20
    assert num_blocks_for_budget(mla, 16, budget) == budget // (16 * 3 * 48 * 4)  # 455
    assert num_blocks_for_budget(full, 16, budget) == budget // (16 * 2 * 3 * 4 * 32 * 4)
    assert num_blocks_for_budget(mla, 16, 1) == 1  # at least one block
