"""Image embeddings on the worker side: the encoder cache, the KV store's embedding namespace,
and putting the rows in place of the image tokens.

- `EncoderCache`: content hash -> [num_embeds, hidden] tensor on the device, LRU bounded in
  bytes. An image seen again (another request, or the next chunk of a chunked prefill) is not
  encoded again; an entry evicted mid-prompt is encoded again (slower, never wrong).
- `EmbeddingStore`: the KV store's embedding namespace, `mm:{fingerprint}:{content_hash}`,
  values in `kvstore.codec`'s block format (versioned header + raw bytes + CRC, bound to the key;
  never pickle). An encoder-only worker (`--role encoder`) writes there; a prefill / both worker
  reads there before encoding, and encodes when the value is missing, corrupt or the store down;
  what it encodes itself it also writes there, in the background (off the step's critical path,
  as KV block saves are), so the next worker or prefill finds it.
- `MultiModalEmbedder`: per step, the input embeddings of the scheduled tokens with the image
  rows put in place of the image tokens, slicing each image's rows by position so a chunked
  prefill may split an image across steps. Like vLLM's encoder cache + `gather_mm_embeddings`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from deepinfer.engine.multimodal import ImageInput
from deepinfer.engine.outputs import MMEncoderStats
from deepinfer.kvstore import KVStore, open_store
from deepinfer.kvstore.codec import BlockHeader, CodecError, decode_block, encode_block

logger = logging.getLogger(__name__)

EMBED_LAYOUT = "mm_embedding:v1"
STORE_DOWN_BACKOFF_S = 1.0   # after a store failure, encode locally this long without asking
MAX_PENDING_SAVES = 16       # background embedding writes in flight; more are dropped (a cache)


def embedding_fingerprint(model_dir: Path, dtype: torch.dtype) -> str:
    """Hex digest naming what an image's embedding depends on: config.json, the processor
    config and the weight files (names, sizes, first MiB), and the dtype."""
    digest = hashlib.blake2b(digest_size=8)
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        if (model_dir / name).exists():
            digest.update((model_dir / name).read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.name.encode() + path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as weights:
            digest.update(weights.read(1 << 20))
    digest.update(str(dtype).encode())
    return digest.hexdigest()


def image_tensors(image: ImageInput, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pixel_values [tiles, 3, H, W] float32, pixel_mask [tiles, H, W] bool or None) on
    `device`, from the image's raw bytes."""
    pixels = torch.from_numpy(np.frombuffer(image.pixel_values, dtype=np.float32).reshape(
        image.pixel_shape).copy()).to(device)
    mask = None
    if image.pixel_mask:
        shape = (image.pixel_shape[0], *image.pixel_shape[2:])
        mask = torch.from_numpy(np.frombuffer(image.pixel_mask, dtype=np.uint8).reshape(
            shape).astype(bool)).to(device)
    return pixels, mask


class EncoderCache:
    """content hash -> embedding tensor, least recently used first out past `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = value
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()


class EmbeddingStore:
    """Blocking get/put of image embeddings in a `KVStore` (its coroutines run on a private
    background loop). Any store failure is a miss (get) or a dropped write (put), logged.

    Args:
        store: the KV store (shared with other workers), or a URL for `open_store`.
        fingerprint: `embedding_fingerprint(...)`, part of every key.
        timeout_s: one operation's limit.
    """

    def __init__(self, store: KVStore | str, fingerprint: str, timeout_s: float = 2.0):
        self.store = open_store(store, timeout_s=timeout_s) if isinstance(store, str) else store
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self._down_until = 0.0
        self._saves: set[concurrent.futures.Future] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="deepinfer-mm-store")
        self._thread.start()

    def key(self, content_hash: str) -> str:
        return f"mm:{self.fingerprint}:{content_hash}"

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(self.timeout_s)

    def _down(self) -> bool:
        """True while backing off after a failure: the step loop does not wait on a store
        that just failed (as `KVTransfer` does for KV blocks)."""
        return time.monotonic() < self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + STORE_DOWN_BACKOFF_S
        logger.warning("embedding store %s failed (%r); encoding locally for %.0f s", what,
                       exc, STORE_DOWN_BACKOFF_S)

    def get(self, content_hash: str) -> tuple[np.ndarray | None, bool]:
        """(embedding [num_embeds, hidden] as stored, corrupt?): (None, False) when absent or
        the store failed, (None, True) when the value did not decode."""
        key = self.key(content_hash)
        if self._down():
            return None, False
        try:
            value = self._run(self.store.get_many([key]))[0]
        except Exception as exc:   # store down or slow: encode instead
            self._failed("get", exc)
            return None, False
        if value is None:
            return None, False
        try:
            header, payload = decode_block(value, key=key)
            if header.layout != EMBED_LAYOUT or len(header.shape) != 2:
                raise CodecError(f"layout {header.layout!r} shape {header.shape}")
            array = np.frombuffer(payload, dtype=_NUMPY[header.dtype]).reshape(header.shape)
        except (CodecError, KeyError, ValueError) as exc:
            logger.warning("stored embedding %s is corrupt (%s); encoding again", key, exc)
            return None, True
        return array, False

    def _value(self, key: str, embedding: torch.Tensor) -> bytes:
        array, dtype = _to_numpy(embedding)
        return encode_block(BlockHeader(EMBED_LAYOUT, dtype, tuple(array.shape)),
                            array.tobytes(), key=key)

    def put(self, content_hash: str, embedding: torch.Tensor) -> bool:
        """Store an embedding [num_embeds, hidden] in its own dtype (bfloat16 as its int16
        bits); False when the store failed (the reader then encodes itself)."""
        key = self.key(content_hash)
        try:
            self._run(self.store.put_many({key: self._value(key, embedding)}))
        except Exception as exc:
            self._failed("put", exc)
            return False
        return True

    def put_later(self, content_hash: str, embedding: torch.Tensor
                  ) -> concurrent.futures.Future | None:
        """`put` without waiting: the device->host copy, encoding and write run on the
        store's background thread (`embedding` must not be modified afterwards; cached
        embeddings never are). None (nothing written) while the store is backing off or
        MAX_PENDING_SAVES writes are in flight. The future's result is whether it was stored."""
        if self._down() or len(self._saves) >= MAX_PENDING_SAVES:
            return None
        key = self.key(content_hash)

        async def save() -> bool:
            try:
                value = await asyncio.to_thread(self._value, key, embedding)
                await asyncio.wait_for(self.store.put_many({key: value}), self.timeout_s)
            except Exception as exc:
                self._failed("put", exc)
                return False
            return True

        future = asyncio.run_coroutine_threadsafe(save(), self._loop)
        self._saves.add(future)
        future.add_done_callback(self._saves.discard)
        return future

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the background writes in flight (`put_later`)."""
        concurrent.futures.wait(list(self._saves), timeout=timeout_s or self.timeout_s + 5)

    def close(self) -> None:
        self.flush()
        try:
            self._run(self.store.close())
        except Exception:   # closing a dead store: nothing to release
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


def _to_numpy(embedding: torch.Tensor) -> tuple[np.ndarray, str]:
    embedding = embedding.detach().cpu().contiguous()
    if embedding.dtype == torch.bfloat16:
        return embedding.view(torch.int16).numpy(), "bfloat16"
    return embedding.numpy(), str(embedding.dtype).removeprefix("torch.")


def _from_numpy(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array.copy())
    if tensor.dtype == torch.int16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(device=device, dtype=dtype)


class MultiModalEmbedder:
    """Image embeddings for a model with `encode_image(pixels, mask)` and `image_token_id`.

    Args:
        encoder: callable (pixel_values, pixel_mask) -> [num_embeds, hidden] (the model's
            `encode_image`, or an encoder-only worker's `Idefics3VisionEncoder`).
        device, dtype: where the embeddings live and their dtype.
        cache_bytes: the encoder cache's bound.
        store: the KV store's embedding namespace, or None.
    """

    def __init__(self, encoder, device: torch.device, dtype: torch.dtype, cache_bytes: int,
                 store: EmbeddingStore | None = None):
        self.encoder = encoder
        self.device, self.dtype = device, dtype
        self.cache = EncoderCache(cache_bytes)
        self.store = store
        self.stats = MMEncoderStats()
        self._lock = threading.Lock()

    def embedding(self, image: ImageInput, *, use_store: bool = True) -> torch.Tensor:
        """[num_embeds, hidden] for the image: from the cache, else the store, else encoded
        (and then kept in the cache, and written to the store in the background)."""
        key = image.content_hash
        cached = self.cache.get(key)
        if cached is not None:
            self.stats.cache_hits += 1
            return cached
        embedding = self._from_store(key) if (use_store and self.store is not None) else None
        if embedding is None:
            embedding = self.encode(image)
            if embedding.shape[0] == image.num_embeds and use_store and self.store is not None:
                saving = self.store.put_later(key, embedding)
                if saving is not None:
                    saving.add_done_callback(self._saved)
        if embedding.shape[0] != image.num_embeds:
            raise ValueError(f"image {key}: {embedding.shape[0]} embeddings for "
                             f"{image.num_embeds} image tokens")
        self.cache.put(key, embedding)
        self.stats.cache_bytes = self.cache.num_bytes
        return embedding

    def _saved(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None and future.result():
            with self._lock:
                self.stats.store_saves += 1

    def encode(self, image: ImageInput) -> torch.Tensor:
        """Run the vision tower on one image (counted in the stats)."""
        started = time.perf_counter()
        pixels, mask = image_tensors(image, self.device)
        with torch.inference_mode():
            embedding = self.encoder(pixels, mask).to(self.dtype)
        self.stats.images_encoded += 1
        self.stats.encode_seconds += time.perf_counter() - started
        return embedding

    def _from_store(self, key: str) -> torch.Tensor | None:
        array, corrupt = self.store.get(key)
        if array is None:
            self.stats.store_misses += 1
            self.stats.store_corrupt += int(corrupt)
            return None
        self.stats.store_hits += 1
        return _from_numpy(array, self.dtype, self.device)

    def encode_and_store(self, image: ImageInput) -> bool:
        """The encoder worker's job: make sure the store holds the image's embedding (skips
        images it already holds intact). Returns whether the store holds it now."""
        if self.store is None:
            raise ValueError("no KV store configured: an encoder worker needs --kv-store")
        array, _ = self.store.get(image.content_hash)
        if array is not None and array.shape[0] == image.num_embeds:
            self.stats.store_hits += 1
            return True
        embedding = self.embedding(image, use_store=False)
        ok = self.store.put(image.content_hash, embedding)
        self.stats.store_saves += int(ok)
        return ok

    def inputs_embeds(self, embed_tokens, input_ids: torch.Tensor, states, num_scheduled,
                      query_start_loc: np.ndarray, image_token_id: int,
                      encoder_inputs: dict[str, list[int]]) -> torch.Tensor | None:
        """The step's input embeddings with image rows in place, or None when no scheduled
        token is an image token (the model then embeds the ids itself).

        Args:
            embed_tokens: the text model's embedding module.
            input_ids: [num_tokens] int64 on the device.
            states: the runner's `CachedRequestState`s in batch order (with `mm_inputs`);
                `num_computed_tokens` still before this step.
            num_scheduled: tokens scheduled per state.
            query_start_loc: [num_seqs + 1] the batch rows of each state.
            encoder_inputs: `SchedulerOutput.scheduled_encoder_inputs`.
        """
        rows, pieces = [], []
        for i, state in enumerate(states):
            indices = encoder_inputs.get(state.request_id)
            if not indices:
                continue
            start = state.num_computed_tokens
            end = start + num_scheduled[i]
            for index in indices:
                image = state.mm_inputs[index]
                span = np.asarray(state.token_ids[image.offset:image.end])
                positions = image.offset + np.flatnonzero(span == image_token_id)
                chosen = np.flatnonzero((positions >= start) & (positions < end))
                if chosen.size == 0:
                    continue
                embedding = self.embedding(image)
                rows.append(int(query_start_loc[i]) + positions[chosen] - start)
                pieces.append(embedding[torch.from_numpy(chosen).to(embedding.device)])
        if not rows:
            return None
        embeds = embed_tokens(input_ids)
        index = torch.from_numpy(np.concatenate(rows)).to(embeds.device)
        embeds[index] = torch.cat(pieces).to(embeds.dtype)
        return embeds

    def snapshot(self) -> MMEncoderStats:
        stats = self.stats
        return MMEncoderStats(**{k: getattr(stats, k) for k in stats.__dataclass_fields__})

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
