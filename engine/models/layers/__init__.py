"""Layers shared by the model families: linear, RMSNorm, rotary embedding, gated MLP, paged
attention. Each documents its tensors' shapes and dtypes."""
