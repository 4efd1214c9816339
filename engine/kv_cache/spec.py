"""Per-layer-group KV layouts: how many bytes one block of one layer takes.

The manager and scheduler only count blocks; the spec turns a memory budget into a block count
and tells the runner what tensor to allocate. New layouts (MLA's one latent vector per token,
sliding window) add a spec here, not a case in the scheduler.

Pure module, no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class KVCacheSpec(Protocol):
    num_layers: int

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

    def block_bytes(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // spec.block_bytes(block_size))
