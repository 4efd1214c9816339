"""Model registry: HF `architectures` name -> model class, imported only when asked for.

Every model class takes `(hf_config, dtype)` and offers `forward(input_ids, positions,
kv_caches, attn_metadata)`, `compute_logits(hidden, float32=True)` (float32=False: the
model dtype), `logits_and_greedy(hidden)` (model-dtype logits and greedy ids), `load_weights`
and `kv_cache_spec(dtype_bytes)` (an `engine.kv_cache.spec` layout: the runner allocates
`spec.num_layers` tensors of `spec.kv_cache_shape(...)`). This module imports no torch.
"""

from __future__ import annotations

import importlib

# architecture -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("deepinfer.engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("deepinfer.engine.models.llama", "Qwen2ForCausalLM"),
    "Idefics3ForConditionalGeneration": ("deepinfer.engine.models.idefics3",
                                         "Idefics3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("deepinfer.engine.models.llava",
                                      "LlavaForConditionalGeneration"),
    "DeepseekV2ForCausalLM": ("deepinfer.engine.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepinfer.engine.models.deepseek", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def get_model_class(hf_config) -> type:
    """The class for the first of `hf_config.architectures` that deepinfer implements.

    Raises:
        ValueError: none of the config's architectures is supported.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for architecture in architectures:
        if architecture in _MODELS:
            module_name, class_name = _MODELS[architecture]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"architectures={architectures} is not supported; deepinfer implements "
                     f"{list(supported_architectures())}. Serve a model of one of those "
                     f"families (its config.json names the architecture).")
