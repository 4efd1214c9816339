"""Tiny random-weight checkpoints saved in HF format, shared by engine and server tests."""

from __future__ import annotations

from pathlib import Path


def word_level_tokenizer(vocab_size: int):
    """A tokenizer of words "t0".."t{vocab_size-1}" (bos "t1", eos "t2"): for GPU tests, whose
    machine lacks the embedded SmolLM2 GGUF."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1", eos_token="t2")


def save_tiny_llama(path: Path, tokenizer, seed: int = 0) -> Path:
    """A 2-layer random Llama (hidden 64, GQA 4:2) with `tokenizer`, saved by HF into `path`.

    initializer_range is large so logits are peaked: greedy choices have clear margins and
    comparisons are not at the mercy of float rounding. Another `seed` gives the same
    config.json with other weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct, chat_template.json): content is
# a list of {"type": "text"|"image"} parts; an image part renders as "<image>"
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}")

IDEFICS3_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                    "<global-img>"]
                   + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def save_tiny_idefics3(path: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny random Idefics3 / SmolVLM (float32) with a real Idefics3 image processor, saved
    by HF into `path` with processor files and SmolVLM's chat template.

    Vision: SigLIP, 2 layers, hidden 32, 64x64 tiles of 16x16 patches; pixel shuffle 2 ->
    4 image tokens per tile. Images are split into tiles of 64 px after resizing their longest
    edge to 128 (up to 2x2 tiles + the global image). Text: the tiny Llama's shape (2 layers,
    hidden 64, GQA 4:2) over the SmolLM2 vocabulary plus the Idefics3 tokens.
    """
    import copy

    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3Processor)
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IDEFICS3_TOKENS)})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=16),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        scale_factor=2, image_token_id=image_token_id, tie_word_embeddings=False,
        architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():   # peaked logits: greedy choices with clear margins
        model.model.connector.modality_projection.proj.weight.mul_(4.0)
    model.save_pretrained(path)
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 128},
                                                max_image_size={"longest_edge": 64})
    Idefics3Processor(image_processor, tokenizer, image_seq_len=4,
                      chat_template=SMOLVLM_CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A random RGB PNG image."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def save_tiny_llava(path: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny random LLaVA (float32): CLIP vision tower (2 layers, hidden 32, 32x32 px of 8x8
    patches -> 16 image tokens, CLS dropped), the MLP projector and the tiny Llama's text shape,
    with a real CLIP image processor and LlavaProcessor files."""
    import copy

    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        architectures=["LlavaForConditionalGeneration"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():   # image rows as large as token embeddings: they move the output
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                            crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor, tokenizer, patch_size=8, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default",
                   chat_template=SMOLVLM_CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
