"""Idefics3 / SmolVLM in the engine vs HF transformers, greedy, on tiny random weights (float32).

The prompt goes through the model's own HF processor files (a real Idefics3 image processor):
our expansion of the `<image>` markers must give HF's `input_ids`, and the engine's greedy tokens
with 1 and 2 images (chunked prefill splitting the images across steps) must equal
`Idefics3ForConditionalGeneration.generate` on the same weights. The same image twice is encoded
once (the encoder cache), and block hashes differ between two images with the same placeholder
tokens (no prefix-cache hit can mix them).
"""

import pytest
import torch

from deepinfer.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig)
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.sampling_params import SamplingParams
from tests.tiny_models import png_bytes, save_tiny_idefics3

pytestmark = pytest.mark.usefixtures("torch_single_thread")
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), smollm2_tokenizer)


def _config(vlm_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(vlm_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=128),
        # 24-token chunks: every image's 20-100 placeholder tokens span several steps
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24))


@pytest.fixture(scope="module")
def core(vlm_dir):
    engine = EngineCore(_config(vlm_dir))
    yield engine
    engine.close()


def prompt_for(core, text, images):
    processor = core.mm_processor
    processed = [processor.process_image(data, f"image {i}") for i, data in enumerate(images)]
    ids = core.tokenizer.encode(processor.expand(text, processed))
    return ids, processor.place(ids, processed)


def run(core, prompts):
    requests = [core.make_request(ids, GREEDY, f"r{n}", mm_inputs=mm)
                for n, (ids, mm) in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    return [finals[r.request_id] for r in requests]


def hf_generate(vlm_dir, text, images):
    from PIL import Image
    import io
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(vlm_dir)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil, return_tensors="pt")
    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_dir,
                                                             dtype=torch.float32).eval()
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


CASES = {
    "one image": ("User:<image>What is in it?<end_of_utterance>\nAssistant:",
                  [png_bytes(100, 70, seed=1)]),
    "two images": ("User:<image>and<image>differ how?<end_of_utterance>\nAssistant:",
                   [png_bytes(40, 40, seed=2), png_bytes(130, 90, seed=3)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_hf(core, vlm_dir, case):
    text, images = CASES[case]
    ids, mm = prompt_for(core, text, images)
    hf_ids, hf_tokens = hf_generate(vlm_dir, text, images)
    assert ids == hf_ids            # the placeholder expansion is the HF processor's
    assert len(mm) == len(images) and all(i.num_embeds % 4 == 0 for i in mm)
    assert run(core, [(ids, mm)]) == [hf_tokens]


def test_same_image_encoded_once_and_hashes_keep_images_apart(core):
    image, other = png_bytes(64, 64, seed=7), png_bytes(64, 64, seed=8)
    text = "User:<image>Look.<end_of_utterance>\nAssistant:"
    stats = core.get_stats().mm_encoder
    before = stats.images_encoded
    first = prompt_for(core, text, [image])
    second = prompt_for(core, text, [image])
    third = prompt_for(core, text, [other])
    assert first[0] == third[0]     # same placeholder tokens for both images
    out = run(core, [first, second])
    assert out[0] == out[1]
    stats = core.get_stats().mm_encoder
    assert stats.images_encoded - before == 1 and stats.cache_hits >= 1
    # again, alone: a prefix-cache hit that ends inside the image's tokens; the rest of the
    # image's rows are sliced out of the cached embedding by position
    request = core.make_request(second[0], GREEDY, "again", mm_inputs=second[1])
    core.add_request(request)
    while core.has_unfinished_requests():
        for done in core.step():
            if done.finished:
                assert done.token_ids == out[0]
    image = second[1][0]
    assert image.offset < request.num_cached_tokens < image.end
    assert core.get_stats().mm_encoder.images_encoded - before == 1
    # the image's blocks hash differently for another image: no prefix-cache hit mixes them
    run(core, [third])
    assert core.get_stats().mm_encoder.images_encoded - before == 2
    requests = [core.make_request(ids, GREEDY, f"h{n}", mm_inputs=mm)
                for n, (ids, mm) in enumerate([first, third])]
    manager = core.scheduler.kv_cache_manager
    for request in requests:
        manager._update_hashes(request, request.num_tokens)
    first_image_block = first[1][0].offset // 16
    assert requests[0].block_hashes[:first_image_block] == \
        requests[1].block_hashes[:first_image_block]
    assert requests[0].block_hashes[first_image_block] != \
        requests[1].block_hashes[first_image_block]


def test_text_only_model_refuses_images(tmp_path, smollm2_tokenizer):
    from tests.tiny_models import save_tiny_llama

    config = EngineConfig(model=ModelConfig(model=str(save_tiny_llama(tmp_path,
                                                                      smollm2_tokenizer)),
                                            dtype="float32", device="cpu"),
                          cache=CacheConfig(block_size=16, num_blocks=16))
    text_core = EngineCore(config)
    try:
        assert text_core.mm_processor is None
        with pytest.raises(ValueError, match="text-only"):
            text_core.make_request([1, 2, 3], GREEDY, mm_inputs=[object()])
    finally:
        text_core.close()


def test_image_tokens_without_images_are_refused(core):
    ids, mm = prompt_for(core, "User:<image>Hi<end_of_utterance>\nAssistant:",
                         [png_bytes(20, 20, seed=9)])
    with pytest.raises(ValueError, match="image tokens"):
        core.make_request(ids, GREEDY, "typed")          # image tokens, no image
    with pytest.raises(ValueError, match="image tokens"):
        core.make_request(ids[:-30], GREEDY, "cut", mm_inputs=mm)   # span cut off


def test_engine_process_carries_the_image_and_gives_the_in_process_tokens(core, vlm_dir):
    """The engine core in its own process (`MPAsyncLLM`): the API process builds the prompt
    with its own `mm_processor`, the image crosses the msgspec wire as data, and the greedy
    tokens equal the in-process engine's; the encoder's stats come back for /metrics."""
    import asyncio

    from deepinfer.engine.async_llm import AsyncLLM

    text, images = CASES["one image"]
    engine = AsyncLLM(_config(vlm_dir).replace(frontend={"engine_process": True}))
    try:
        assert type(engine).__name__ == "MPAsyncLLM" and engine.mm_processor is not None
        assert engine.tokenizer.chat_template == core.tokenizer.chat_template
        ids, mm = prompt_for(engine, text, images)
        assert (ids, mm) == prompt_for(core, text, images)
        want = run(core, [(ids, mm)])[0]

        async def generate():
            tokens = []
            async for out in engine.generate(ids, GREEDY, "img", mm_inputs=mm):
                tokens += out.new_token_ids
            return tokens
        assert asyncio.run(generate()) == want
        assert engine.get_stats().mm_encoder.images_encoded == 1
    finally:
        engine.shutdown()
