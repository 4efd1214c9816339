"""LLaVA in the engine vs HF transformers, greedy, tiny random weights (float32): the HF
processor's expansion gives HF's input_ids, and greedy tokens with 1 and 2 images equal
`LlavaForConditionalGeneration.generate` (chunked prefill splits the images across steps)."""

import io

import pytest
import torch

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.engine_core import EngineCore
from tests.engine.test_idefics3 import MAX_NEW, prompt_for, run
from tests.tiny_models import png_bytes, save_tiny_llava

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), smollm2_tokenizer)


def test_greedy_tokens_equal_hf_with_one_and_two_images(llava_dir):
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava_dir)
    hf = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    core = EngineCore(EngineConfig(
        model=ModelConfig(model=str(llava_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=12)))
    try:
        for text, images in (("USER: <image>\nWhat is it? ASSISTANT:", [png_bytes(50, 40, 1)]),
                             ("USER: <image> or <image>? ASSISTANT:",
                              [png_bytes(40, 40, 2), png_bytes(64, 30, 3)])):
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            inputs = processor(text=text, images=pil, return_tensors="pt")
            expected = hf.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
            ids, mm = prompt_for(core, text, images)
            assert ids == inputs["input_ids"][0].tolist()
            assert [i.num_embeds for i in mm] == [16] * len(images)
            assert run(core, [(ids, mm)]) == [expected[0, len(ids):].tolist()]
    finally:
        core.close()
