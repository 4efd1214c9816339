"""`kernels.l2_prefetch.prefetch_l2`: the bulk L2 prefetch runs over any size it supports,
eagerly and inside a CUDA graph, and changes no byte of memory (the weight, and the sink the
kernel could only write if the prefetch instruction returned non-zero)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("evict_last", [False, True])
@pytest.mark.parametrize("numel", [8192, 8200, 1 << 20, 5_000_008])
def test_prefetch_reads_only(numel, evict_last):
    from deepinfer.kernels import l2_prefetch

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    weight = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    before = weight.clone()
    assert l2_prefetch.supported(weight)
    l2_prefetch.prefetch_l2(weight, evict_last=evict_last)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        l2_prefetch.prefetch_l2(weight, evict_last=evict_last)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before)
    assert int(l2_prefetch._sink(weight.device).item()) == 0


def test_small_or_misaligned_weights_are_left_alone():
    from deepinfer.kernels import l2_prefetch

    assert not l2_prefetch.supported(torch.zeros(100, device="cuda"))          # < 16 KiB
    assert not l2_prefetch.supported(torch.zeros(8193, dtype=torch.bfloat16,
                                                 device="cuda"))                # not % 16
    assert not l2_prefetch.supported(torch.zeros(64, 512, device="cuda").t())  # strided
    assert not l2_prefetch.supported(torch.zeros(8192, dtype=torch.bfloat16))  # CPU
