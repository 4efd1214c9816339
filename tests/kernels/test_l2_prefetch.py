"""L2 prefetch of weights on a side stream (kernels/l2_prefetch.py).

A prefetch is a hint, so what is checked is that it changes nothing: outside a region, on CPU
and before sm_90 it issues nothing; on an H100/H200 the kernel runs over ragged sizes and leaves
the bytes as they were, and a CUDA graph holding forked prefetches gives bit-equal outputs to
the same work with none, replayed on new inputs.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import l2_prefetch

HOPPER = torch.cuda.is_available() and l2_prefetch.supported(torch.device("cuda"))
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90+ CUDA device + Triton")


def test_outside_a_region_nothing_is_issued(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "stream", lambda *a: calls.append(a))
    l2_prefetch.prefetch_weight(torch.zeros(64))
    assert calls == []


def test_cpu_region_is_a_no_op():
    weight = torch.randn(32, 16)
    before = weight.clone()
    assert not l2_prefetch.supported(torch.device("cpu"))
    with l2_prefetch.weight_prefetch(torch.device("cpu")):
        assert l2_prefetch._region.get() is None
        l2_prefetch.prefetch_weight(weight)
    assert torch.equal(weight, before)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("num_bytes", [16, 16 * 1025, 5 << 20, 40 << 20 | 48])
def test_kernel_runs_over_ragged_sizes(num_bytes):
    from kernels import l2_prefetch_triton

    data = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    before = data.clone()
    for chunk in (16, 4096, l2_prefetch_triton.CHUNK_BYTES):
        l2_prefetch_triton.prefetch(data.data_ptr(), num_bytes, chunk)
    torch.cuda.synchronize()
    assert torch.equal(data, before)


@pytest.mark.gpu
@requires_hopper
def test_graph_with_prefetches_is_bit_equal_to_plain_work():
    gen = torch.Generator().manual_seed(0)
    w1, w2, w3 = (torch.randn(n, k, generator=gen).to(torch.bfloat16).cuda()
                  for n, k in ((512, 256), (256, 512), (1024, 256)))
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16).cuda()

    def work():
        with l2_prefetch.weight_prefetch(x.device):
            l2_prefetch.prefetch_weight(w1)
            h = F.silu(F.linear(x, w1))
            l2_prefetch.prefetch_weight(w2, max_bytes=4096)
            h = F.linear(h, w2) + x
            l2_prefetch.prefetch_weight(w3)
            return F.linear(h, w3)

    def reference():
        return F.linear(F.linear(F.silu(F.linear(x, w1)), w2) + x, w3)

    work()                                    # compiles the kernel, makes the side stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = work()
    for seed in (1, 2, 3):
        x.copy_(torch.randn(4, 256, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, reference())
    assert torch.equal(work(), reference())  # eagerly too, joined back on exit
