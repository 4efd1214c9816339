"""Per-layer-group KV layouts: how many bytes one block of one layer takes.

The manager and scheduler only count blocks; the spec turns a memory budget into a block count
and tells the runner what tensor to allocate per layer (`kv_cache_shape`). New layouts add a spec
here, not a case in the scheduler. A model declares its spec (`model.kv_cache_spec(dtype_bytes)`).

- `FullAttentionSpec`: K and V per kv-head (Llama / Qwen2).
- `MLAAttentionSpec`: one latent vector per token (DeepSeek-V2/V3 Multi-head Latent Attention,
  arXiv 2405.04434 §2.1): the compressed KV `c_KV` (kv_lora_rank values) and the shared rotary
  key `k_R` (qk_rope_head_dim values), whatever the number of heads.

Pure module, no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class KVCacheSpec(Protocol):
    num_layers: int
    dtype_bytes: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""
        ...

    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers of the group."""
        ...

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers of the group."""
        ...


@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V per kv-head: per layer a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token()


@dataclass(frozen=True)
class MLAAttentionSpec:
    """One latent vector per token: per layer a tensor [num_blocks, block_size, latent_dim] with
    latent_dim = kv_lora_rank + qk_rope_head_dim; values [:kv_lora_rank] are the normalised
    compressed KV, [kv_lora_rank:] the rotated shared key."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype_bytes: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.latent_dim)

    def bytes_per_token(self) -> int:
        return self.num_layers * self.latent_dim * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token()


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // spec.block_bytes(block_size))
