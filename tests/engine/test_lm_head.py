"""`CausalLMLogits.logits_and_greedy` (engine/models/layers/lm_head.py): the decode graph's LM
head and greedy ids. Off CUDA (and for heads the skinny GEMM does not run) the ids come from
`greedy_argmax` on the logits; on CUDA with a tuned LM head shape they come from the GEMM's
epilogue (tests/kernels/test_linear_triton.py, test_linear_gluon.py)."""

import torch
from torch import nn

from deepinfer.engine.models.layers.linear import Linear
from deepinfer.engine.models.layers.lm_head import CausalLMLogits
from deepinfer.engine.sampler import greedy_argmax


class _Head(CausalLMLogits, nn.Module):
    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self.lm_head = lm_head


def _linear_head(bias: bool) -> Linear:
    head = Linear(16, 40, bias=bias, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    head.weight.copy_(torch.randn(40, 16, generator=gen))
    if bias:
        head.bias.copy_(torch.randn(40, generator=gen))
    head.weight[7] = head.weight[23] = 10.0       # equal, leading logits for positive rows
    return head


def test_logits_and_greedy_match_compute_logits_and_greedy_argmax():
    hidden = torch.rand(5, 16) + 0.1
    for lm_head in (_linear_head(bias=False), _linear_head(bias=True),
                    nn.Linear(16, 40, bias=False)):
        model = _Head(lm_head)
        logits, greedy_ids = model.logits_and_greedy(hidden)
        assert torch.equal(logits, model.compute_logits(hidden, float32=False))
        assert greedy_ids.dtype == torch.int64
        assert torch.equal(greedy_ids, greedy_argmax(logits))
    assert torch.equal(_Head(_linear_head(bias=False)).logits_and_greedy(hidden)[1],
                       torch.full((5,), 7))    # the first of the tied maxima
