"""YaRN rotary scaling (arXiv 2309.00071) vs transformers' `_compute_yarn_parameters`: the
same inverse frequencies (float32, rtol 1e-6) and attention factor, and the softmax mscale² of
DeepSeek's MLA (`yarn_apply_mscale`)."""

import pytest
import torch

from deepinfer.engine.models.layers.mla import softmax_scale
from deepinfer.engine.models.layers.rotary import (RotaryEmbedding, inverse_frequencies,
                                         rotary_attention_factor)

CASES = [
    dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.8),
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707,
         beta_fast=32, beta_slow=1),  # DeepSeek-V2 / V3's values
    dict(factor=8.0, original_max_position_embeddings=128),  # attention factor from factor only
    dict(factor=2.0, original_max_position_embeddings=256, truncate=False, beta_fast=16),
]


@pytest.mark.parametrize("params", CASES)
def test_yarn_matches_transformers(params):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16,
                              qk_nope_head_dim=16, max_position_embeddings=8192,
                              rope_parameters=dict(rope))
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(inverse_frequencies(16, rope), hf_inv_freq, rtol=1e-6, atol=0)
    assert rotary_attention_factor(rope) == pytest.approx(hf_factor, rel=1e-12)
    assert softmax_scale(config) == pytest.approx(yarn_apply_mscale(rope, 32 ** -0.5),
                                                  rel=1e-12)


def test_rotary_table_carries_the_attention_factor():
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 128}
    cos, signed_sin = RotaryEmbedding(16, 256, rope)(torch.tensor([0, 5]), torch.float32)
    factor = rotary_attention_factor(rope)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    torch.testing.assert_close(cos[0, 0], torch.full((16,), factor))  # position 0: cos = 1
    assert float(signed_sin[1].pow(2).add(cos[1].pow(2)).max()) == pytest.approx(factor ** 2,
                                                                                  rel=1e-6)
