"""Idefics3 / SmolVLM: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model.

The text model is our paged `LlamaForCausalLM` (engine/models/llama.py) built from
`hf_config.text_config`; its `forward` takes `inputs_embeds` where the model runner has put the
image embeddings in place of the image tokens. The vision tower and connector are transformers'
own modules (`Idefics3VisionTransformer`, `Idefics3Connector`: plain torch, exact), held by
`Idefics3VisionEncoder`, which an encoder-only worker builds alone (`--role encoder`).
Checkpoint names: `model.vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*`.
Reference: transformers' modeling_idefics3.py (`Idefics3Model.get_image_features`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.engine.models.llama import LlamaForCausalLM

_VISION_PREFIXES = ("model.vision_model.", "model.connector.")


class Idefics3VisionEncoder(nn.Module):
    """Vision tower + connector: image tiles -> text-space embeddings.

    Args:
        hf_config: the Idefics3 config (vision_config, scale_factor, text hidden size).
        dtype: parameter dtype.
    """

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers.models.idefics3.modeling_idefics3 import (Idefics3Connector,
                                                                    Idefics3VisionTransformer)

        vision_config = hf_config.vision_config
        vision_config._attn_implementation = "sdpa"
        self.vision_model = Idefics3VisionTransformer(vision_config).to(dtype)
        self.connector = Idefics3Connector(hf_config).to(dtype)
        self.patch_size = vision_config.patch_size
        self.dtype = dtype
        self.hidden_size = hf_config.text_config.hidden_size

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Encode one image's tiles.

        Args:
            pixel_values: [num_tiles, 3, H, W] float (the HF processor's output for one image).
            pixel_mask: [num_tiles, H, W] bool (True = real pixel), or None for all real.
        Returns:
            [num_tiles * image_seq_len, text_hidden_size] in the model dtype: the rows that
            replace the image tokens, in order.
        """
        pixel_values = pixel_values.to(self.dtype)
        if pixel_mask is None:
            pixel_mask = torch.ones(pixel_values.shape[0], *pixel_values.shape[2:],
                                    dtype=torch.bool, device=pixel_values.device)
        size = self.patch_size
        subgrid = pixel_mask.unfold(1, size, size).unfold(2, size, size)
        patch_mask = subgrid.sum(dim=(-1, -2)) > 0          # [tiles, H/p, W/p]
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask,
                                   return_dict=True).last_hidden_state
        features = self.connector(hidden)                    # [tiles, seq, text_hidden]
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill from `model.vision_model.*` / `model.connector.*` checkpoint tensors (others
        are skipped).

        Raises:
            ValueError: a shape mismatch or a parameter left unfilled.
        """
        ours = ((hf_name.removeprefix("model."), tensor) for hf_name, tensor in weights
                if hf_name.startswith(_VISION_PREFIXES))
        fill_vision_parameters(self, ours, "an Idefics3 / SmolVLM vision encoder")


def fill_vision_parameters(encoder: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                           what: str) -> None:
    """Copy (parameter name, tensor) pairs into `encoder`'s parameters, every one exactly once.

    Raises:
        ValueError: a name `encoder` lacks, a shape mismatch, or a parameter left unfilled.
    """
    params = dict(encoder.named_parameters())
    filled = set()
    for name, tensor in weights:
        if name not in params or params[name].shape != tensor.shape:
            expected = tuple(params[name].shape) if name in params else "no such parameter"
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit "
                             f"{what} (expected: {expected}); is the checkpoint for this "
                             "model?")
        params[name].data.copy_(tensor)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:4]}.")


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The paged Llama text model plus `vision` (an `Idefics3VisionEncoder`).

    `image_token_id`: the placeholder token whose input embeddings the runner replaces.
    `encode_image(pixel_values, pixel_mask)` is `vision.forward`.
    """

    batch_invariant_devices = ()   # its vision encoder batches images

    is_multimodal = True

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        super().__init__(hf_config.text_config, dtype)
        self.vision = Idefics3VisionEncoder(hf_config, dtype)
        self.image_token_id = int(hf_config.image_token_id)
        self.hf_vlm_config = hf_config

    def encode_image(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None
                     ) -> torch.Tensor:
        return self.vision(pixel_values, pixel_mask)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Vision / connector tensors to `vision`, `model.text_model.*` and `lm_head.*` to the
        Llama text model (see `LlamaForCausalLM.load_weights`)."""
        vision, text = [], []
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIXES):
                vision.append((name, tensor))
            else:
                text.append((name.replace("model.text_model.", "model.", 1), tensor))
        self.vision.load_weights(vision)
        super().load_weights(text)

    @staticmethod
    def _expected_fills(params: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
        """The text model's fills (`vision.*` is filled and checked by `vision.load_weights`)."""
        return LlamaForCausalLM._expected_fills(
            {name: p for name, p in params.items() if not name.startswith("vision.")})
