"""LLaVA (`LlavaForConditionalGeneration`): a CLIP / SigLIP vision tower, a two-layer MLP
projector and a Llama text model.

As in engine/models/idefics3.py: the text model is our paged `LlamaForCausalLM`, the vision tower
and projector are transformers' own modules (`AutoModel.from_config(vision_config)`,
`LlavaMultiModalProjector`). An image's embedding rows are the projector applied to the
`vision_feature_layer` hidden states (without the CLS row under the "default" strategy), one row
per image token. Reference: transformers' modeling_llava.py (`LlavaModel.get_image_features`).
Checkpoint names: transformers 5 (`model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.language_model.*`, `lm_head.*`) and the older llava-hf layout (`vision_tower.*`,
`multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.engine.models.idefics3 import fill_vision_parameters
from deepinfer.engine.models.llama import LlamaForCausalLM

_RENAMES = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model."),
            ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class LlavaVisionEncoder(nn.Module):
    """Vision tower + projector: [1, 3, H, W] pixels -> [num_patches(-1), text_hidden]."""

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        hf_config.vision_config._attn_implementation = "sdpa"
        self.vision_tower = AutoModel.from_config(hf_config.vision_config).to(dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config).to(dtype)
        self.feature_layer = hf_config.vision_feature_layer
        self.strategy = hf_config.vision_feature_select_strategy
        self.dtype = dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """pixel_values: [num_images, 3, H, W] (one image here); pixel_mask unused.
        Returns [num_images * tokens_per_image, text_hidden] in the model dtype."""
        out = self.vision_tower(pixel_values.to(self.dtype), output_hidden_states=True,
                                return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else \
            list(self.feature_layer)
        states = [out.hidden_states[i] for i in layers]
        if self.strategy == "default":
            states = [s[:, 1:] for s in states]      # drop the CLS row
        features = self.multi_modal_projector(torch.cat(states, dim=-1))
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill from (our name, tensor) pairs under `_VISION_PREFIXES`.

        Raises:
            ValueError: an unknown name, a shape mismatch or a parameter left unfilled.
        """
        fill_vision_parameters(self, weights, "the LLaVA vision tower / projector")


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The paged Llama text model plus `vision` (a `LlavaVisionEncoder`); see
    `Idefics3ForConditionalGeneration` for the multimodal surface."""

    batch_invariant_devices = ()   # its vision encoder batches images

    is_multimodal = True

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        super().__init__(hf_config.text_config, dtype)
        self.vision = LlavaVisionEncoder(hf_config, dtype)
        self.image_token_id = int(hf_config.image_token_id)

    def encode_image(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None
                     ) -> torch.Tensor:
        return self.vision(pixel_values, pixel_mask)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision, text = [], []
        for name, tensor in weights:
            name = _rename(name)
            (vision if name.startswith(_VISION_PREFIXES) else text).append((name, tensor))
        self.vision.load_weights(vision)
        super().load_weights(text)

    @staticmethod
    def _expected_fills(params: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
        return LlamaForCausalLM._expected_fills(
            {name: p for name, p in params.items() if not name.startswith("vision.")})
