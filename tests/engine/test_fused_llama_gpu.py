"""Llama on CUDA in bf16 with its RMSNorm weights folded into qkv / gate_up and the decode
linears fused (`kernels/fused_linear.py`), against the same model with fusion off and against
HF transformers (unfolded weights).

The norm weights are randomised (HF initialises them to ones, which would make the fold a
no-op). A config file naming the tiny model's shapes makes every decode linear run fused. Greedy
tokens of a bf16 run can flip on one rounding, so the check is on logits: decode steps fed the
same tokens on every side; the relative error of the decode logits, fused against unfused and
each against HF bf16, must stay < 5e-2 (bf16 rounding through 3 random layers: 0.018 fused
against unfused, 0.034 / 0.033 fused / unfused against HF on the H200).
"""

import json

import pytest
import torch
from test_llama_parity import PagedDriver

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 8


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def tiny_bf16_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return save_with_random_norms(LlamaForCausalLM, config, tmp_path)


def save_with_random_norms(model_class, config, path):
    """An HF `model_class(config)` of seed-0 random weights, its RMSNorm weights randomised
    around 1 (HF's ones would make a fold a no-op), saved to `path`; returns path."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


@pytest.fixture(params=[(16, 3), (64, 40)], ids=["16_rows", "64_rows"])
def fused_everywhere(request, monkeypatch, tmp_path_factory):
    """A fused_linear config file with the tiny model's shapes all fused, at 16 rows (3
    prompts) or at 64 (40 prompts: on Hopper the Gluon GEMM, `KernelConfig.gluon_block_m`).
    Yields (kernels.fused_linear, number of prompts)."""
    from deepinfer.kernels import backends, fused_linear

    block_m, num_prompts = request.param
    config = {"BLOCK_N": 32 if block_m == 16 else 64, "BLOCK_K": 64, "num_warps": 4,
              "num_stages": 2, "SPLIT_K": 1}
    shapes = [("norm", 256 + 2 * 64, 256), ("norm_gated", 1024, 256),   # qkv, gate_up
              ("residual", 256, 256), ("residual", 256, 512)]           # o, down
    entries = [{"fusion": fusion, "block_m": block_m, "out_features": n, "in_features": k,
                "config": config, "fused_faster": True} for fusion, n, k in shapes]
    write_fused_config(monkeypatch, tmp_path_factory.mktemp("configs"), entries)
    yield fused_linear, num_prompts
    backends.tuned_table.cache_clear()


def write_fused_config(monkeypatch, directory, entries: list[dict]) -> None:
    """Point the tuned-config directory at `directory` and write there this device's
    fused_linear file with `entries` (the tables are rebuilt on their next use)."""
    from deepinfer.kernels import backends, fused_linear

    monkeypatch.setattr(backends, "CONFIG_DIR", directory)
    backends.device_config_path(fused_linear.CONFIG_KIND, torch.cuda.get_device_name()
                                ).write_text(json.dumps({"entries": entries}))
    backends.tuned_table.cache_clear()


def decode_logits(model, prompts, continuations):
    """Prefill all prompts in one step, then NEW_TOKENS decode steps fed `continuations`;
    [NEW_TOKENS, num_prompts, vocab] float32 logits of the decode steps."""
    driver = PagedDriver(model, num_blocks=256, block_size=16, device="cuda")
    driver.step({seq: prompt for seq, prompt in enumerate(prompts)})
    steps = []
    for step in range(NEW_TOKENS):
        rows = driver.step({seq: [tokens[step]] for seq, tokens in enumerate(continuations)})
        steps.append(torch.stack([rows[seq] for seq in range(len(prompts))]))
    return torch.stack(steps)


def test_fused_folded_decode_matches_unfused_and_hf(tiny_bf16_dir, fused_everywhere):
    from transformers import LlamaForCausalLM

    from deepinfer.engine.loader import load_model
    from deepinfer.engine.models.layers import set_kernel_config
    from deepinfer.kernels.settings import KernelConfig

    fused_everywhere, num_prompts = fused_everywhere
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist()
               for n in (7, 30, 12, *range(5, 5 + num_prompts - 3))]
    continuations = [torch.randint(3, 512, (NEW_TOKENS,), generator=gen).tolist()
                     for _ in prompts]
    ours = load_model(tiny_bf16_dir, torch.bfloat16, "cuda")
    assert all(layer.norms_folded for layer in ours.layers)
    qkv_rows = torch.zeros(num_prompts, 256, dtype=torch.bfloat16, device="cuda")
    assert fused_everywhere.fused_config("norm", qkv_rows, ours.layers[0].self_attn.qkv_proj
                                         .weight) is not None
    fused = decode_logits(ours, prompts, continuations)
    set_kernel_config(ours, KernelConfig(fused_linears=False))
    unfused = decode_logits(ours, prompts, continuations)
    assert _rel(fused, unfused) < 5e-2
    hf = LlamaForCausalLM.from_pretrained(tiny_bf16_dir, dtype=torch.bfloat16).cuda().eval()
    for seq, (prompt, tokens) in enumerate(zip(prompts, continuations)):
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.inference_mode():
            hf_logits = hf(ids).logits[0, len(prompt):].float()        # [NEW_TOKENS, vocab]
        errors = _rel(fused[:, seq], hf_logits), _rel(unfused[:, seq], hf_logits)
        print(f"prompt {seq}: relative error against HF fused {errors[0]:.4f}, unfused "
              f"{errors[1]:.4f}")
        assert max(errors) < 5e-2, f"prompt {seq}"
