"""The MTP module (DeepSeek-V3 report, arXiv 2412.19437 §2.2) loaded from checkpoint layer
`num_hidden_layers` vs a plain torch re-implementation of its equations:

    h'_i   = M [RMSNorm_e(Emb(t_{i+1})) ; RMSNorm_h(h_i)]     (eh_proj; the checkpoints' order)
    h''    = TRM(h'_{1:T})                                     (one causal transformer block)
    logits = OutHead(RMSNorm_s(h''))                            (shared embedding and head)

with TRM transformers' own DeepseekV3DecoderLayer on the same weights (eager attention over the
whole sequence, no cache). The report writes the concatenation as [h ; Emb]; DeepSeek-V3
checkpoints, vLLM, SGLang and transformers' MtpLayer feed eh_proj [Emb ; h], which is what the
weights were trained with. Tolerance: float32, atol 1e-4 / rtol 1e-4.
"""

import pytest
import torch
from deepseek_configs import randomize_router_bias, tiny_deepseek_config
from safetensors.torch import save_file
from test_llama_parity import PagedDriver

from deepinfer.engine.loader import load_model
from deepinfer.kernels.attention_metadata import AttentionMetadata

pytestmark = pytest.mark.usefixtures("torch_single_thread")
VARIANT = "v3_qlora_noaux_tc_yarn"


def _mtp_weights(config, lm_head, embed, seed=7):
    """Random weights of MTP layer `num_hidden_layers`: {checkpoint name: tensor} and the HF
    decoder block holding the same block weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    index = config.num_hidden_layers
    block = DeepseekV3DecoderLayer(config, layer_idx=index).eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.normal_(0.0, 0.1) if "norm" not in name else param.uniform_(0.5, 1.5)
        block.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.5)
    prefix = f"model.layers.{index}."
    hidden = config.hidden_size
    tensors = {f"{prefix}{k}": v.clone() for k, v in block.state_dict().items()}
    # the conversion-free HF names of experts: one tensor per expert and projection
    experts = block.mlp.experts
    for name in [n for n in tensors if ".experts." in n]:
        del tensors[name]
    inter = config.moe_intermediate_size
    for e in range(config.n_routed_experts):
        tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = experts.gate_up_proj[e, :inter]
        tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = experts.gate_up_proj[e, inter:]
        tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = experts.down_proj[e]
    extra = {"enorm.weight": torch.rand(hidden) + 0.5, "hnorm.weight": torch.rand(hidden) + 0.5,
             "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.1,
             "shared_head.norm.weight": torch.rand(hidden) + 0.5,
             "shared_head.head.weight": lm_head, "embed_tokens.weight": embed}
    tensors.update({f"{prefix}{k}": v.clone().contiguous() for k, v in extra.items()})
    return {k: v.detach().contiguous() for k, v in tensors.items()}, block


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(dir, HF config, main HF model, HF MTP block, MTP checkpoint tensors)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-deepseek-mtp")
    config = tiny_deepseek_config(VARIANT)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    randomize_router_bias(hf_model)
    hf_model.save_pretrained(path)
    tensors, block = _mtp_weights(config, hf_model.lm_head.weight.data,
                                  hf_model.model.embed_tokens.weight.data)
    save_file(tensors, path / "model-mtp.safetensors", metadata={"format": "pt"})
    return path, config, hf_model, block, tensors


def _prefill_metadata(num_tokens: int, block_size: int) -> AttentionMetadata:
    """One sequence computed from position 0 in blocks 0, 1, 2, ..."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(-(-num_tokens // block_size), dtype=torch.int32)[None],
        slot_mapping=torch.arange(num_tokens), max_query_len=num_tokens,
        max_seq_len=num_tokens, query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens])


def _reference_mtp(config, block, tensors, hidden, next_tokens, embed, lm_head):
    """The equations above in plain torch (+ the HF block as TRM)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    prefix = f"model.layers.{config.num_hidden_layers}."

    def rms_norm(x, name):
        weight = tensors[f"{prefix}{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    projected = torch.cat([rms_norm(embed[next_tokens], "enorm"), rms_norm(hidden, "hnorm")],
                          dim=-1) @ tensors[f"{prefix}eh_proj.weight"].T  # [T, hidden]
    num_tokens = hidden.shape[0]
    positions = torch.arange(num_tokens)[None]
    rope = DeepseekV3RotaryEmbedding(config)(projected[None], positions)
    mask = torch.full((num_tokens, num_tokens), float("-inf")).triu(1)[None, None]
    trm = block(projected[None], attention_mask=mask, position_ids=positions,
                position_embeddings=rope)[0]  # [T, hidden]
    return rms_norm(trm, "shared_head.norm") @ lm_head.T, trm


def test_mtp_module_loads_from_layer_num_hidden_layers(mtp_checkpoint):
    path, config, *_ = mtp_checkpoint
    ours = load_model(path, torch.float32, "cpu")
    assert ours.num_mtp_layers == 1 and ours.num_hidden_layers == 3
    assert ours.kv_cache_spec(4).num_layers == 4  # the MTP block caches its own latents


def test_mtp_forward_matches_published_equations(mtp_checkpoint):
    path, config, hf_model, block, tensors = mtp_checkpoint
    ours = load_model(path, torch.float32, "cpu")
    tokens = [5, 9, 200, 31, 7, 64, 3, 18, 99, 4, 250]
    driver = PagedDriver(ours, num_blocks=16, block_size=4)
    metadata = _prefill_metadata(len(tokens) - 1, 4)
    with torch.inference_mode():
        hidden = ours(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1),
                      driver.kv_caches, metadata)  # main model h_i, i = 0..T-1
        draft_logits, mtp_hidden = ours.mtp_forward(
            hidden, torch.tensor(tokens[1:]), torch.arange(len(tokens) - 1), driver.kv_caches,
            metadata)
        expected_logits, expected_hidden = _reference_mtp(
            config, block, tensors, hidden, torch.tensor(tokens[1:]),
            hf_model.model.embed_tokens.weight, hf_model.lm_head.weight)
    assert draft_logits.shape == (len(tokens) - 1, config.vocab_size)
    assert draft_logits.dtype == torch.float32
    torch.testing.assert_close(mtp_hidden, expected_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(draft_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert driver.kv_caches[3][:3].abs().sum() > 0  # latents written into the MTP layer's cache


def test_mtp_depth_beyond_checkpoint_is_refused(mtp_checkpoint):
    ours = load_model(mtp_checkpoint[0], torch.float32, "cpu")
    with pytest.raises(ValueError, match="MTP depth 1 requested"):
        ours.mtp_forward(torch.zeros(1, 64), torch.zeros(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long), [], None, depth=1)
