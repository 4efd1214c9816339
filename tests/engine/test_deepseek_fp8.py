"""FP8 block-scaled checkpoints (DeepSeek-V3 format): a tiny model quantized into float8_e4m3fn
weights with a `weight_scale_inv` per block loads, dequantized at load to float32, into exactly
the weights of its dequantized reference, and generates what transformers generates from that
reference (logits atol 1e-4); against the unquantized original it stays within FP8 error."""

import json

import pytest
import torch
from deepseek_configs import randomize_router_bias, tiny_deepseek_config
from safetensors.torch import load_file, save_file
from test_llama_parity import PagedDriver, generate_greedy, hf_greedy, load_hf_reference

from deepinfer.engine.loader import load_model
from deepinfer.engine.models.fp8 import dequantize_fp8_weights, fp8_block_size
from deepinfer.kernels.fp8 import dequantize_block_fp8, quantize_block_fp8

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The linears DeepSeek-V3 ships in FP8: every projection inside the layers (attention,
    dense MLP, experts, shared experts); not embeddings, norms, router or LM head."""
    return (name.startswith("model.layers.") and name.endswith("_proj.weight")
            and tensor.dim() == 2)


@pytest.fixture(scope="module", params=[(128, 128), (32, 16)], ids=["block128", "block32x16"])
def fp8_dirs(request, tmp_path_factory):
    """(original dir, FP8 dir, dequantized-reference dir) of one tiny V3 model."""
    from transformers import AutoModelForCausalLM

    block = request.param
    root = tmp_path_factory.mktemp(f"fp8-{block[0]}x{block[1]}")
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_deepseek_config("v3_qlora_noaux_tc_yarn"))
    randomize_router_bias(hf_model)
    hf_model.save_pretrained(root / "original")
    tensors = load_file(root / "original" / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        fp8[name] = dequantized[name] = tensor
        if _is_quantized(name, tensor):
            weight, scale_inv = quantize_block_fp8(tensor, block)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = weight, scale_inv
            dequantized[name] = dequantize_block_fp8(weight, scale_inv, block, torch.float32)
    config = json.loads((root / "original" / "config.json").read_text())
    for name, weights, quant in (("fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3",
                                               "activation_scheme": "dynamic",
                                               "weight_block_size": list(block)}),
                                 ("dequantized", dequantized, None)):
        (root / name).mkdir()
        save_file(weights, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(
            {**config, "quantization_config": quant} if quant else config))
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
