"""Block hashes for prefix caching: a hash chain over full blocks of token ids.

`h_i = H(h_{i-1} || token ids of block i || extra)` with H = BLAKE2b-64 over a fixed byte
encoding, so a hash is stable across processes and machines (never Python's `hash()`); `extra`
carries whatever changes the KV for the same tokens (model fingerprint, dtype, block size).
A request's `cache_salt` (vLLM's name) goes into the first block's hash only: the chain carries
it to every later block, so requests with different salts share no cached block, here or in the
KV store (whose keys are these hashes), and cache hits cannot leak one user's prompt to another.
Scheme as in vLLM's prefix caching (vllm/v1/core/kv_cache_utils.py) and SGLang's radix keys.

Pure module: no torch import.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: list[int], extra: bytes = b"") -> int:
    """64-bit hash of one full block chained on its parent's hash.

    Args:
        parent_hash: hash of the previous block (`ROOT_HASH` for the first block).
        token_ids: the block's token ids (exactly block_size of them).
        extra: bytes that distinguish KV layouts and models for the same tokens.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra)
    return int.from_bytes(digest.digest(), "little")


def salt_bytes(cache_salt: str | None) -> bytes:
    """The bytes a salt adds to the first block's `extra` (empty for no salt; length-prefixed,
    so no salt is a suffix of another's encoding)."""
    if not cache_salt:
        return b""
    raw = cache_salt.encode("utf-8", "surrogatepass")
    return b"salt" + len(raw).to_bytes(8, "little") + raw


def extend_block_hashes(block_hashes: list[int], token_ids_of, num_tokens: int,
                        block_size: int, extra: bytes = b"", cache_salt: str | None = None,
                        mm_extra_of=None) -> None:
    """Append the hashes of every block made full by the first `num_tokens` tokens.

    Args:
        block_hashes: the chain so far, extended in place.
        token_ids_of: callable (start, end) -> token ids [start, end).
        num_tokens: tokens whose ids are known.
        cache_salt: mixed into the first block's hash (None = unsalted, shared by all).
        mm_extra_of: callable (start, end) -> bytes naming the images whose placeholder
            tokens lie in [start, end) (`engine.multimodal.block_mm_extra`), or None.
    """
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for index in range(len(block_hashes), num_tokens // block_size):
        start = index * block_size
        block_extra = extra + salt_bytes(cache_salt) if index == 0 else extra
        if mm_extra_of is not None:
            block_extra += mm_extra_of(start, start + block_size)
        parent = hash_block_tokens(parent, token_ids_of(start, start + block_size), block_extra)
        block_hashes.append(parent)
