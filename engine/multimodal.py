"""Images as plain data on their way through the engine (no torch import).

An `ImageInput` is one image of a request after the model's own HF image processor ran on it
(engine/mm_processor.py): its pixel values as raw float32 bytes with their shape, a content hash,
and where its placeholder tokens sit in the prompt. It crosses process boundaries as plain data
(bytes, ints, strings: msgpack/msgspec-friendly, never pickle).

The placeholder span `[offset, offset + length)` runs from the image's first image token to its
last (for Idefics3 the tokens between tiles, like `<row_1_col_2>`, lie inside it and keep their
own embeddings); the positions in it whose token is the model's image token receive the
encoder's output rows, in order. Block hashes of blocks that overlap a span include the image's
hash (`block_mm_extra`), so a prefix-cache or KV-store hit can never mix two images with the same
placeholder tokens; later blocks inherit it through the hash chain. Scheme as vLLM's
`PlaceholderRange` + `mm_hashes` in its block keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image.

    content_hash: hex BLAKE2b-128 of the pixel values and their shape (`pixel_hash`); the key
        of the encoder cache and of the KV store's embedding namespace.
    pixel_values: raw little-endian float32 bytes of shape `pixel_shape` =
        [num_tiles, channels, height, width] (the HF processor's `pixel_values` of this image).
    pixel_mask: raw uint8 bytes of shape [num_tiles, height, width] (1 = real pixel), or b""
        when every pixel is real.
    offset, length: the placeholder span in the prompt's token ids (`place_images`).
    num_embeds: how many of the span's tokens are image tokens (encoder output rows).
    """

    content_hash: str
    pixel_values: bytes
    pixel_shape: tuple[int, ...]
    pixel_mask: bytes = b""
    offset: int = 0
    length: int = 0
    num_embeds: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    def placed(self, offset: int, length: int, num_embeds: int) -> "ImageInput":
        """A copy at another place in the prompt."""
        return ImageInput(self.content_hash, self.pixel_values, self.pixel_shape,
                          self.pixel_mask, offset, length, num_embeds)


def pixel_hash(pixel_values: bytes, shape: tuple[int, ...], pixel_mask: bytes = b"") -> str:
    """Hex BLAKE2b-128 over shape, pixel bytes and mask: equal for equal processed images
    whatever their file encoding (a PNG and a lossless WebP of one picture share it)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(tuple(shape)).encode())
    digest.update(pixel_values)
    digest.update(pixel_mask)
    return digest.hexdigest()


def place_images(token_ids: list[int], images: list[ImageInput],
                 image_token_id: int) -> list[ImageInput]:
    """Find each image's span in expanded token ids and return the images placed there.

    The span runs from the image's first image token to its last (the tokens between tiles,
    like `<row_1_col_2>`, lie inside it and keep their own embeddings); images are matched in
    prompt order and take `num_embeds` image tokens each. Text blocks before the span do not
    depend on the image; blocks after it inherit its hash through the hash chain.

    Raises:
        ValueError: the prompt holds a different number of image tokens than the images need.
    """
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    needed = sum(image.num_embeds for image in images)
    if len(positions) != needed:
        raise ValueError(f"the prompt holds {len(positions)} image tokens but its "
                         f"{len(images)} image(s) need {needed}; send each image once, as a "
                         "content part, and do not type image tokens into the text.")
    placed, cursor = [], 0
    for image in images:
        first, last = positions[cursor], positions[cursor + image.num_embeds - 1]
        cursor += image.num_embeds
        placed.append(image.placed(first, last + 1 - first, image.num_embeds))
    return placed


def images_in_range(images: list[ImageInput], start: int, end: int) -> list[int]:
    """Indices of the images whose span overlaps token positions [start, end)."""
    return [i for i, image in enumerate(images) if image.offset < end and start < image.end]


def block_mm_extra(images: list[ImageInput], block_start: int, block_end: int) -> bytes:
    """The bytes a block's hash adds for the images overlapping it (empty for none)."""
    hashes = [images[i].content_hash for i in images_in_range(images, block_start, block_end)]
    if not hashes:
        return b""
    return b"mm" + b"".join(bytes.fromhex(h) for h in hashes)
