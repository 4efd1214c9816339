"""The vision encoder as its own worker (`deepinfer serve MODEL --role encoder`).

Loads only the vision tower and connector of a vision-language model (no text model, no KV
cache), preprocesses images with the model's HF processor and stores each image's embedding in
the KV store's embedding namespace (engine/mm_encoder.py `EmbeddingStore`), where prefill and
`both` workers of the same model and dtype look them up before encoding themselves. vLLM calls
the split "EPD" (encode / prefill / decode), SGLang "encoder disaggregation".
"""

from __future__ import annotations

import logging
import threading

import torch

from deepinfer.engine import loader
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.engine_core import resolve_device_dtype, served_model_name
from deepinfer.engine.mm_encoder import EmbeddingStore, MultiModalEmbedder, embedding_fingerprint
from deepinfer.engine.mm_processor import load_mm_processor
from deepinfer.engine.outputs import MMEncoderStats

logger = logging.getLogger(__name__)


class EncoderWorker:
    """Args:
        config: the engine config; `kv_transfer.kv_store` must be a shared store
            (redis://...), `model.model` a vision-language model's HF directory.
    Raises:
        ValueError: a text-only model, or no shared store.
    """

    def __init__(self, config: EngineConfig):
        from deepinfer.engine.models.idefics3 import Idefics3VisionEncoder

        self.model_dir = loader.resolve_model_dir(config.model.model, config.model.cache_dir)
        self.model_name = served_model_name(config.model)
        hf_config = loader.load_hf_config(self.model_dir)
        self.mm_processor = load_mm_processor(self.model_dir, hf_config, config.multimodal)
        if self.mm_processor is None:
            raise ValueError(f"{self.model_name} has no vision encoder deepinfer implements; "
                             "--role encoder serves vision-language models (Idefics3/SmolVLM).")
        store_url = config.kv_transfer.kv_store
        if not store_url.startswith(("redis://", "rediss://")):
            raise ValueError("--role encoder hands embeddings to other workers through a shared "
                             "store; give --kv-store redis://host:port/db.")
        device, dtype = resolve_device_dtype(config.model)
        with torch.device(device):
            encoder = Idefics3VisionEncoder(hf_config, dtype)
        encoder.load_weights(loader.iter_safetensors(self.model_dir))
        encoder.eval()
        store = EmbeddingStore(store_url, embedding_fingerprint(self.model_dir, dtype),
                               config.kv_transfer.timeout_s)
        self.embedder = MultiModalEmbedder(encoder, device, dtype,
                                           config.multimodal.encoder_cache_bytes, store)
        self.tokenizer = None
        self.max_model_len = 0
        self._lock = threading.Lock()   # one encode at a time (the device is shared)
        logger.info("encoder worker: %s vision tower on %s (%s), store %s", self.model_name,
                    device, dtype, store_url.split("@")[-1])

    def encode_and_store(self, processed: list) -> list[dict]:
        """Encode the images (`ProcessedImage`s) the store lacks and store them.

        Returns one {"hash", "num_embeds", "stored"} per image."""
        out = []
        with self._lock:
            for item in processed:
                stored = self.embedder.encode_and_store(item.image)
                out.append({"hash": item.image.content_hash,
                            "num_embeds": item.image.num_embeds, "stored": stored})
        return out

    def abort_all(self, reason: str) -> int:
        """Nothing queued to abort (an encode runs to its end); the drain's hook."""
        return 0

    def get_stats(self) -> MMEncoderStats:
        return self.embedder.snapshot()

    def shutdown(self) -> None:
        self.embedder.close()
