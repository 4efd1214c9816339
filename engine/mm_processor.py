"""Image bytes -> `ImageInput`s and an expanded prompt, through the model's own HF processor.

Preprocessing (resize, split into tiles, rescale, normalize) is the HF image processor's
(transformers `AutoProcessor.from_pretrained(model_dir)`, Pillow underneath); the placeholder
expansion is the HF processor's own `replace_image_token` (Idefics3: one `<image>` marker becomes
rows x cols tiles of `image_seq_len` image tokens plus a global image; LLaVA: one image token per
patch). Each image is processed
alone, so its pixel values, and its content hash, do not depend on the other images of the
request. No torch here: pixel values stay numpy until the model runner.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepinfer.engine.multimodal import ImageInput, pixel_hash, place_images

IMAGE_MARKER = "<image>"


class ImageError(ValueError):
    """An image that cannot be used (not an image, truncated, too large); the message says
    which and how to fix it."""


_VLM_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "LlavaForConditionalGeneration")


def is_multimodal(hf_config) -> bool:
    """True for a config with a vision tower the engine implements (Idefics3 / SmolVLM,
    LLaVA)."""
    return getattr(hf_config, "vision_config", None) is not None and any(
        a in _VLM_ARCHITECTURES for a in getattr(hf_config, "architectures", None) or [])


@dataclass
class ProcessedImage:
    """An image ready for the engine (not yet placed in a prompt) and its prompt text."""

    image: ImageInput
    replacement: str        # the text that stands for the image in the prompt


class MultiModalProcessor:
    """The model's HF processor behind two calls: `process_image(bytes)` and
    `place(token_ids, images)`.

    Args:
        model_dir: the HF directory with preprocessor_config.json / processor_config.json.
        hf_config: its config (`image_token_id`; Idefics3's vision `image_size` /
            `patch_size` and `scale_factor`).
        max_image_pixels: larger decoded images are refused (width x height).
    """

    def __init__(self, model_dir: str | Path, hf_config, max_image_pixels: int = 64_000_000):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.image_processor = self.processor.image_processor
        self.tiled = hasattr(hf_config, "scale_factor")   # Idefics3: tiles + a global image
        if self.tiled:
            vision = hf_config.vision_config
            self.processor.image_seq_len = int((vision.image_size // vision.patch_size) ** 2
                                               / hf_config.scale_factor ** 2)
        self.image_token = self.processor.image_token
        self.image_token_id = int(hf_config.image_token_id)
        self.max_image_pixels = max_image_pixels

    def decode(self, data: bytes, where: str = "image"):
        """Bytes -> an RGB `PIL.Image`, fully loaded.

        Raises:
            ImageError: not an image Pillow can read, truncated, or more than max_image_pixels.
        """
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as probe:
                width, height = probe.size
                if width * height > self.max_image_pixels:
                    raise ImageError(f"{where} is {width}x{height} pixels, more than the "
                                     f"{self.max_image_pixels} allowed; send a smaller image.")
                probe.load()
                return probe.convert("RGB")
        except ImageError:
            raise
        except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
            raise ImageError(f"{where} is not an image Pillow can read ({exc}); send PNG, "
                             "JPEG, WebP or GIF bytes.") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(f"{where} could not be decoded ({exc}); it may be truncated. "
                             "Send the whole file.") from None

    def process_image(self, data: bytes, where: str = "image") -> ProcessedImage:
        """Decode and preprocess one image with the HF image processor.

        Returns the unplaced `ImageInput` (pixel values [tiles, 3, H, W] float32 bytes) and the
        text that replaces its marker in the prompt.
        """
        image = self.decode(data, where)
        if self.tiled:
            out = self.image_processor(images=[[image]], return_tensors="np",
                                       return_row_col_info=True)
            pixels = out["pixel_values"][0]            # [tiles, 3, H, W]
        else:
            out = self.image_processor(images=[image], return_tensors="np")
            pixels = out["pixel_values"]               # [1, 3, H, W]
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        mask = out.get("pixel_attention_mask")
        mask_bytes = b""
        if mask is not None and not np.asarray(mask).all():
            mask_bytes = np.ascontiguousarray(mask[0], dtype=np.uint8).tobytes()
        replacement = self._replacement(out)
        shape = tuple(int(d) for d in pixels.shape)
        raw = pixels.tobytes()
        item = ImageInput(pixel_hash(raw, shape, mask_bytes), raw, shape, mask_bytes,
                          num_embeds=replacement.count(self.image_token))
        return ProcessedImage(item, replacement)

    def _replacement(self, out) -> str:
        """The HF processor's own expansion of one image marker (`replace_image_token`; its
        signature differs across transformers 5 releases, and 4.x has the module function)."""
        processor = self.processor
        if not self.tiled:
            if hasattr(processor, "replace_image_token"):
                return processor.replace_image_token(out, 0)
            height, width = out["pixel_values"].shape[-2:]
            count = (height // processor.patch_size) * (width // processor.patch_size) + getattr(
                processor, "num_additional_image_tokens", 0)
            if getattr(processor, "vision_feature_select_strategy", None) == "default":
                count -= 1
            return self.image_token * count
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        if hasattr(processor, "replace_image_token"):
            return processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0,
                                                 image_seq_len=processor.image_seq_len)
        from transformers.models.idefics3.processing_idefics3 import get_image_prompt_string

        return get_image_prompt_string(rows, cols, processor.image_seq_len,
                                       processor.fake_image_token.content
                                       if hasattr(processor.fake_image_token, "content")
                                       else processor.fake_image_token,
                                       self.image_token, processor.global_image_tag)

    @staticmethod
    def expand(text: str, processed: list[ProcessedImage]) -> str:
        """Replace the i-th `<image>` marker of `text` by image i's replacement text.

        Raises:
            ValueError: the text holds another number of markers than there are images.
        """
        pieces = text.split(IMAGE_MARKER)
        if len(pieces) - 1 != len(processed):
            raise ValueError(f"the prompt holds {len(pieces) - 1} {IMAGE_MARKER} markers for "
                             f"{len(processed)} image(s); do not type {IMAGE_MARKER} in text.")
        out = [pieces[0]]
        for item, piece in zip(processed, pieces[1:]):
            out += [item.replacement, piece]
        return "".join(out)

    def place(self, token_ids: list[int], processed: list[ProcessedImage]) -> list[ImageInput]:
        """The images placed at their spans in the expanded, tokenized prompt."""
        return place_images(token_ids, [p.image for p in processed], self.image_token_id)


def load_mm_processor(model_dir: str | Path, hf_config, config=None
                      ) -> MultiModalProcessor | None:
    """The directory's `MultiModalProcessor`, or None for a text-only model.

    Args:
        config: an `engine.config.MultiModalConfig` (its `max_image_pixels`), or None.
    """
    if not is_multimodal(hf_config):
        return None
    max_pixels = config.max_image_pixels if config is not None else 64_000_000
    return MultiModalProcessor(model_dir, hf_config, max_image_pixels=max_pixels)


def adopt_chat_template(tokenizer, mm_processor: MultiModalProcessor | None) -> None:
    """Give `tokenizer` the processor's chat template when it has none of its own (SmolVLM
    ships its template with the processor). Called wherever a tokenizer renders chat prompts:
    the engine core, and the API server process of an engine core process."""
    template = getattr(getattr(mm_processor, "processor", None), "chat_template", None)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
