"""`rebalance_experts` (engine/moe/eplb.py): placement validity, and balance against a plain
re-implementation of DeepSeek's greedy policy (github.com/deepseek-ai/EPLB, written out here
loop by loop) on Zipf-like loads and on all tokens on one expert."""

import pytest
import torch

from deepinfer.engine.moe.eplb import balancedness, rebalance_experts


def _greedy_packing(weight, num_packs):
    """DeepSeek's balanced_packing: heaviest first into the lightest pack with room."""
    rows, n = weight.shape
    per_pack = n // num_packs
    pack = torch.full((rows, n), -1, dtype=torch.int64)
    rank = torch.full((rows, n), -1, dtype=torch.int64)
    for r in range(rows):
        loads, items = [0.0] * num_packs, [0] * num_packs
        for item in weight[r].sort(descending=True).indices.tolist():
            p = min((q for q in range(num_packs) if items[q] < per_pack), key=loads.__getitem__)
            pack[r, item], rank[r, item] = p, items[p]
            loads[p] += float(weight[r, item])
            items[p] += 1
    return pack, rank


def _greedy_replicate(weight, num_phy):
    rows, num_log = weight.shape
    phy2log = torch.arange(num_phy).repeat(rows, 1)
    count = torch.ones(rows, num_log, dtype=torch.int64)
    for r in range(rows):
        for slot in range(num_log, num_phy):
            e = int((weight[r] / count[r]).argmax())
            phy2log[r, slot] = e
            count[r, e] += 1
    return phy2log, count


def greedy_balancedness(weight, num_replicas, num_gpus):
    """DeepSeek's global policy (replicate, then greedy packing to GPUs): max/mean per layer."""
    phy2log, count = _greedy_replicate(weight, num_replicas)
    replica_load = (weight / count).gather(-1, phy2log)
    pack, _ = _greedy_packing(replica_load, num_gpus)
    rank_load = torch.zeros(weight.shape[0], num_gpus).scatter_add_(1, pack, replica_load)
    return rank_load.max(-1).values / rank_load.mean(-1)


def zipf_loads(layers, experts, s, seed):
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1).float() ** s
    rows = [base[torch.randperm(experts, generator=gen)] for _ in range(layers)]
    return torch.poisson(torch.stack(rows) * 1e4, generator=gen)


def check_placement(phy2log, log2phy, count, num_logical, num_replicas):
    layers = phy2log.shape[0]
    assert phy2log.shape == (layers, num_replicas)
    assert count.shape == (layers, num_logical) and bool((count >= 1).all())
    assert bool((count.sum(-1) == num_replicas).all())
    # counts match the physical map, and logical_to_physical lists exactly those slots
    assert torch.equal(torch.zeros_like(count).scatter_add_(1, phy2log, torch.ones_like(phy2log)),
                       count)
    assert log2phy.shape == (layers, num_logical, int(count.max()))
    assert torch.equal((log2phy >= 0).sum(-1), count)
    for layer in range(layers):
        slots = log2phy[layer][log2phy[layer] >= 0]
        assert sorted(slots.tolist()) == list(range(num_replicas))   # each slot once
        experts = torch.arange(num_logical)[:, None].expand_as(log2phy[layer])
        assert torch.equal(phy2log[layer][slots], experts[log2phy[layer] >= 0])


@pytest.mark.parametrize("num_logical,num_replicas,groups,nodes,gpus", [
    (64, 80, 8, 2, 8),      # hierarchical (V2-Lite-sized)
    (64, 72, 8, 3, 6),      # 3 nodes do not divide 8 groups: global
    (16, 16, 4, 1, 4),      # no redundancy
])
def test_placement_is_valid_and_each_gpu_holds_its_share(num_logical, num_replicas, groups,
                                                         nodes, gpus):
    weight = zipf_loads(5, num_logical, 1.0, seed=1)
    phy2log, log2phy, count = rebalance_experts(weight, num_replicas, groups, nodes, gpus)
    check_placement(phy2log, log2phy, count, num_logical, num_replicas)
    per_gpu = num_replicas // gpus
    assert phy2log.view(5, gpus, per_gpu).shape[-1] == per_gpu
    if nodes == 2:   # hierarchical: every replica of an expert stays on one node
        node_of_slot = torch.arange(num_replicas) // (num_replicas // nodes)
        for layer in range(5):
            for e in range(num_logical):
                assert node_of_slot[log2phy[layer, e, :count[layer, e]]].unique().numel() == 1


@pytest.mark.parametrize("s", [0.6, 1.0, 1.4])
def test_at_least_as_balanced_as_deepseek_greedy_on_zipf_loads(s):
    weight = zipf_loads(6, 64, s, seed=int(s * 10))
    phy2log, log2phy, count = rebalance_experts(weight, 80, 1, 1, 8)   # global policy
    ours = balancedness(weight, phy2log, count, 8)
    theirs = greedy_balancedness(weight, 80, 8)
    assert bool((ours <= theirs * (1 + 1e-6)).all()), (ours, theirs)
    assert float(ours.max()) <= 1.05 or s >= 1.4


def test_all_tokens_on_one_expert():
    weight = torch.zeros(3, 64)
    weight[:, 7] = 1000.0
    phy2log, log2phy, count = rebalance_experts(weight, 72, 1, 1, 8)
    check_placement(phy2log, log2phy, count, 64, 72)
    # the hot expert takes every redundant slot; its 9 replicas on 8 GPUs: the best possible
    # is one GPU with two (2/9 of the load against a mean of 1/8)
    assert bool((count[:, 7] == 9).all())
    ours = balancedness(weight, phy2log, count, 8)
    assert torch.allclose(ours, torch.full((3,), 16 / 9))
    assert bool((ours <= greedy_balancedness(weight, 72, 8) * (1 + 1e-6)).all())


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        rebalance_experts(torch.ones(1, 64), 70, 8, 1, 8)
    with pytest.raises(ValueError, match="logical experts need"):
        rebalance_experts(torch.ones(1, 64), 56, 8, 1, 8)
