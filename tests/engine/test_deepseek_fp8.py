"""FP8 block-scaled checkpoints (DeepSeek-V3 format): a tiny model quantized into float8_e4m3fn
weights with a `weight_scale_inv` per block loads, dequantized at load to float32, into exactly
the weights of its dequantized reference, and generates what transformers generates from that
reference (logits atol 1e-4); against the unquantized original it stays within FP8 error."""

import json

import pytest
import torch
from deepseek_configs import randomize_router_bias, tiny_deepseek_config, write_fp8_dirs
from safetensors.torch import load_file, save_file
from test_llama_parity import PagedDriver, generate_greedy, hf_greedy, load_hf_reference

from deepinfer.engine.loader import load_model
from deepinfer.engine.models.fp8 import dequantize_fp8_weights, fp8_block_size
from deepinfer.kernels.fp8 import dequantize_block_fp8, quantize_block_fp8

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module", params=[(128, 128), (32, 16)], ids=["block128", "block32x16"])
def fp8_dirs(request, tmp_path_factory):
    """(original dir, FP8 dir, dequantized-reference dir) of one tiny V3 model."""
    block = request.param
    return _write_fp8_dirs(tmp_path_factory.mktemp(f"fp8-{block[0]}x{block[1]}"),
                           tiny_deepseek_config("v3_qlora_noaux_tc_yarn"), block)


@pytest.fixture(scope="module")
def fp8_expert_dirs(tmp_path_factory):
    """The same for a tiny V3 whose experts can stay FP8: hidden and moe_intermediate sizes of
    128, 128 x 128 blocks."""
    config = tiny_deepseek_config("v3_qlora_noaux_tc_yarn", hidden_size=128,
                                  moe_intermediate_size=128)
    return _write_fp8_dirs(tmp_path_factory.mktemp("fp8-experts"), config, (128, 128))


def _write_fp8_dirs(root, hf_config, block):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    randomize_router_bias(hf_model)
    hf_model.save_pretrained(root / "original")
    write_fp8_dirs(root / "original", root / "fp8", root / "dequantized", block)
    return root / "original", root / "fp8", root / "dequantized"


def test_fp8_checkpoint_holds_float8_blocks(fp8_dirs):
    tensors = load_file(fp8_dirs[1] / "model.safetensors")
    weight = tensors["model.layers.1.self_attn.kv_b_proj.weight"]  # [160, 32]
    scale = tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    block = json.loads((fp8_dirs[1] / "config.json").read_text())[
        "quantization_config"]["weight_block_size"]
    assert scale.shape == (-(-160 // block[0]), -(-32 // block[1]))


def test_fp8_load_equals_dequantized_reference_exactly(fp8_dirs):
    _, fp8_dir, reference_dir = fp8_dirs
    ours = load_model(fp8_dir, torch.float32, "cpu").state_dict()
    reference = load_model(reference_dir, torch.float32, "cpu").state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


def test_fp8_model_generates_like_hf_on_the_dequantized_weights(fp8_dirs):
    from transformers import AutoModelForCausalLM

    original_dir, fp8_dir, reference_dir = fp8_dirs
    prompts = [[5, 9, 200, 31, 7, 64, 3], list(range(100, 121))]
    ours = load_model(fp8_dir, torch.float32, "cpu")
    tokens, logits = generate_greedy(PagedDriver(ours, num_blocks=64, block_size=4), prompts)
    hf_tokens, hf_logits = hf_greedy(load_hf_reference(AutoModelForCausalLM, reference_dir),
                                     prompts)
    assert tokens == hf_tokens
    for seq in range(len(prompts)):
        torch.testing.assert_close(logits[seq], hf_logits[seq], atol=1e-4, rtol=1e-4)
    # FP8 error vs the unquantized original, first token's logits: e4m3 keeps 3 mantissa bits,
    # so each weight moves by ~2.7% (relative L2); through 3 layers of ~8 projections the
    # logits move by ~8% (observed 0.06-0.09). Bound: 15%.
    _, original_logits = hf_greedy(load_hf_reference(AutoModelForCausalLM, original_dir),
                                   prompts)
    for seq in range(len(prompts)):
        expected = original_logits[seq][0]
        error = (logits[seq][0] - expected).norm() / expected.norm()
        assert 0 < error < 0.15


def test_dequantize_stream_pairs_weights_and_scales_in_any_order():
    weight, scale = quantize_block_fp8(torch.randn(5, 7), (4, 4))
    stream = [("a.weight_scale_inv", scale), ("b.weight", torch.ones(2)), ("a.weight", weight)]
    out = dict(dequantize_fp8_weights(stream, (4, 4), torch.float32))
    assert out.keys() == {"a.weight", "b.weight"}
    torch.testing.assert_close(out["a.weight"], dequantize_block_fp8(weight, scale, (4, 4),
                                                                     torch.float32))
    with pytest.raises(ValueError, match="without their pair"):
        list(dequantize_fp8_weights([("a.weight", weight)], (4, 4), torch.float32))
    with pytest.raises(ValueError, match="needs \\(2, 2\\)"):
        dequantize_block_fp8(weight, scale[:1], (4, 4), torch.float32)


def test_quantization_config_is_checked():
    class Config:
        quantization_config = {"quant_method": "awq"}

    with pytest.raises(ValueError, match="quant_method='awq' is not supported"):
        fp8_block_size(Config())
    Config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_block_size(Config())
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert fp8_block_size(Config()) == (128, 128)


def test_fp8_linears_kept_in_fp8_generate_like_the_dequantized_model(fp8_dirs):
    """`keep_fp8=True` (what a Hopper GPU gets by default) on CPU: the linears whose checkpoint
    rows line up with the scale tiles hold float8 codes + scales and run the dequantizing
    fallback of `fp8_block_linear`; kv_b_proj and the LM head stay float32. Same weights, so
    the same greedy tokens, logits within float32 summation order (atol 1e-5)."""
    from deepinfer.engine.loader import iter_safetensors, load_hf_config
    from deepinfer.engine.models.layers.linear import Linear
    from deepinfer.engine.models import get_model_class

    _, fp8_dir, reference_dir = fp8_dirs
    config = load_hf_config(fp8_dir)
    ours = get_model_class(config)(config, torch.float32)
    ours.load_weights(iter_safetensors(fp8_dir), keep_fp8=True)
    ours.eval()
    kept = {name for name, m in ours.named_modules()
            if isinstance(m, Linear) and m.weight_scale_inv is not None}
    assert kept and not any("kv_b_proj" in n or n == "lm_head" for n in kept)
    assert "layers.0.self_attn.o_proj" in kept
    for name in kept:
        assert ours.get_submodule(name).weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="merged"):   # FP8 q_a / kv_a: the input norms stay
        ours.fold_norms()
    assert not any(layer.norms_folded for layer in ours.layers)
    prompts = [[5, 9, 200, 31, 7, 64, 3], list(range(100, 121))]
    tokens, logits = generate_greedy(PagedDriver(ours, num_blocks=64, block_size=4), prompts)
    reference = load_model(reference_dir, torch.float32, "cpu")
    ref_tokens, ref_logits = generate_greedy(PagedDriver(reference, num_blocks=64,
                                                         block_size=4), prompts)
    assert tokens == ref_tokens
    for seq in range(len(prompts)):
        torch.testing.assert_close(logits[seq], ref_logits[seq], atol=1e-5, rtol=1e-5)


def _fp8_expert_model(model_dir):
    """The model of `model_dir` built with FP8 experts on CPU (what a Hopper GPU gets by
    default), weights loaded."""
    from deepinfer.engine.loader import iter_safetensors, load_hf_config
    from deepinfer.engine.models import get_model_class

    config = load_hf_config(model_dir)
    model = get_model_class(config)(config, torch.float32, fp8_experts=True)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()


def test_fp8_experts_keep_the_checkpoint_codes_and_scales(fp8_expert_dirs):
    """Built with FP8 experts, every routed expert holds the stored
    float8 codes and weight_scale_inv tiles, half the bytes of the bf16 experts; the rest of
    the model equals the dequantized reference, and the experts dequantize to it exactly."""
    from deepinfer.kernels.moe import dequantize_blocks

    _, fp8_dir, reference_dir = fp8_expert_dirs
    ours = _fp8_expert_model(fp8_dir)
    reference = load_model(reference_dir, torch.float32, "cpu")
    stored = load_file(fp8_dir / "model.safetensors")
    moes = [m for m in ours.modules() if type(m).__name__ == "MoE"]
    assert len(moes) == 2   # layers 1 and 2 (HF saves no MTP layer)
    layer = ours.layers[1].mlp.moe
    assert layer.w13.dtype == layer.w2.dtype == torch.float8_e4m3fn
    assert layer.w13.element_size() == 1 and layer.w13_scale.shape == (8, 2, 1)
    prefix = "model.layers.1.mlp.experts.5."
    codes = layer.w13.data[5].view(torch.uint8)
    assert torch.equal(codes[:128], stored[prefix + "gate_proj.weight"].view(torch.uint8))
    assert torch.equal(codes[128:], stored[prefix + "up_proj.weight"].view(torch.uint8))
    assert torch.equal(layer.w2_scale[5], stored[prefix + "down_proj.weight_scale_inv"])
    expected = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        if name.endswith((".w13", ".w2")):
            moe = ours.get_submodule(name.rsplit(".", 1)[0])
            scale = getattr(moe, name.rsplit(".", 1)[1] + "_scale")
            tensor = dequantize_blocks(tensor, scale, torch.float32)
        assert torch.equal(tensor, expected[name]), name


def test_fp8_experts_generate_what_the_dequantized_model_generates(fp8_expert_dirs):
    """On CPU the FP8 experts dequantize in the forward to the weights the reference
    dequantized at load: the same greedy tokens and bitwise equal logits."""
    _, fp8_dir, reference_dir = fp8_expert_dirs
    prompts = [[5, 9, 200, 31, 7, 64, 3], list(range(100, 121))]
    tokens, logits = generate_greedy(PagedDriver(_fp8_expert_model(fp8_dir), num_blocks=64,
                                                 block_size=4), prompts)
    reference = load_model(reference_dir, torch.float32, "cpu")
    ref_tokens, ref_logits = generate_greedy(PagedDriver(reference, num_blocks=64,
                                                         block_size=4), prompts)
    assert tokens == ref_tokens
    for seq in range(len(prompts)):
        assert torch.equal(logits[seq], ref_logits[seq])


def test_fp8_experts_need_a_checkpoint_that_allows_them(fp8_dirs, fp8_expert_dirs, tmp_path):
    """fp8_experts=True on 32-wide experts or 32 x 16 blocks is refused; on CPU the default
    keeps them dequantized; a checkpoint with one expert stored unquantized is refused with a
    message naming it."""
    from deepinfer.engine.loader import iter_safetensors, load_hf_config
    from deepinfer.engine.models import get_model_class

    config = load_hf_config(fp8_dirs[1])
    with pytest.raises(ValueError, match="multiples of 128"):
        get_model_class(config)(config, torch.float32, fp8_experts=True)
    assert load_model(fp8_expert_dirs[1], torch.float32, "cpu").layers[1].mlp.moe.w13.dtype \
        == torch.float32
    stored = load_file(fp8_expert_dirs[1] / "model.safetensors")
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    stored[name] = dequantize_block_fp8(stored[name], stored.pop(name + "_scale_inv"),
                                        (128, 128), torch.float32)
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = load_hf_config(fp8_expert_dirs[1])
    model = get_model_class(config)(config, torch.float32, fp8_experts=True)
    with pytest.raises(ValueError, match="experts.3.down_proj.weight' is torch.float32"):
        model.load_weights(iter_safetensors(tmp_path))
