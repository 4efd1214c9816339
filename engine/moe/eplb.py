"""Expert-parallel load balancer (EPLB): from per-layer logical expert loads, decide how many
physical replicas each logical expert gets and which GPU (EP rank) holds each replica.

Same contract as DeepSeek's EPLB (github.com/deepseek-ai/EPLB, `eplb.rebalance_experts`):
- hierarchical policy when the expert groups divide evenly over the nodes: pack groups to nodes
  (balanced by group load), replicate experts within each node, pack replicas to the node's GPUs;
  keeps a token's experts (group-limited routing) on few nodes.
- global policy otherwise: replicate over all experts, pack replicas to all GPUs.

Our own, vectorised implementation (every step is a tensor op over all layers at once; the only
Python loops run over replicas-to-add and items-per-pack, never over experts x layers):
1. Replication: the greedy "give the next replica to the expert with the highest load per
   replica" (which minimises the maximum replica load, as DeepSeek's `replicate_experts`), one
   vectorised step per redundant replica.
2. Packing (n items to m packs of exactly n/m items): DeepSeek's greedy longest-processing-time
   packing (heaviest item first into the lightest pack that is not full), vectorised over rows;
   then a swap refinement that repeatedly takes the heaviest pack and makes the one exchange of
   an item with any other pack that lowers their larger load most. Refinement only accepts
   strict improvements of the heaviest pack, so the result is never worse than the greedy
   packing's.

Pure tensor code on the CPU (int64/float32); no torch.distributed, no model.
"""

from __future__ import annotations

import torch

__all__ = ["rebalance_experts", "balancedness", "pack_balanced", "replicate_experts"]

PAIR_ROUNDS = 16  # refinement rounds pairing heavy with light packs (many swaps per row each)
SWAP_ROUNDS = 24  # then rounds of the heaviest pack against all others (<= 1 swap per row)
NEAR_OPTIMAL = 2e-4  # stop refining a row this close (relative) to its lower bound


def replicate_experts(weight: torch.Tensor, num_physical: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give `num_physical - num_logical` extra replicas to the experts with the highest load
    per replica (greedy; minimises the maximum replica load).

    Args:
        weight: [rows, num_logical] float32 loads.
        num_physical: replicas in all (>= num_logical).
    Returns:
        phy2log [rows, num_physical] int64 (the first num_logical are the identity),
        replica_rank [rows, num_physical] int64 (0 for the first replica of an expert),
        count [rows, num_logical] int64 replicas per expert (>= 1).
    """
    rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} logical "
                         "ones; give at least one replica per expert.")
    extra = num_physical - num_logical
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_physical, dtype=torch.int64)
    count = torch.ones(rows, num_logical, dtype=torch.int64)
    if extra == 0:
        return phy2log, rank, count
    # The greedy gives expert e its (c+1)-th replica when w_e / c is the largest load per
    # replica left; w_e / c falls with c, so its picks are the `extra` largest of all
    # {w_e / c : c = 1..extra} at once (ties: lower expert first, as the greedy's argmax).
    per_replica = weight[:, :, None] / torch.arange(1, extra + 1, dtype=weight.dtype)
    picks = per_replica.view(rows, -1).topk(extra, dim=-1, sorted=True).indices
    experts = picks // extra                                          # [rows, extra]
    count += torch.zeros_like(count).scatter_add_(1, experts, torch.ones_like(experts))
    experts = experts.sort(dim=-1, stable=True).values               # replicas by expert
    phy2log[:, num_logical:] = experts
    first = torch.cumsum(count - 1, dim=-1) - (count - 1)            # start of e's extras
    rank[:, num_logical:] = (torch.arange(extra).expand(rows, extra) - first.gather(1, experts)
                             + 1)
    return phy2log, rank, count


def _round_pack(weight: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Longest-processing-time packing in rounds, vectorised over rows: the items in descending
    weight, `num_packs` per round; each round gives its heaviest item to the lightest pack, its
    second to the second lightest, and so on (every pack takes one item per round, so all end
    with n / num_packs). weight [rows, n] -> members [rows, num_packs, n / num_packs] int64."""
    rows, n = weight.shape
    per_pack = n // num_packs
    order = weight.sort(dim=-1, descending=True, stable=True).indices
    sorted_w = weight.gather(1, order).view(rows, per_pack, num_packs)
    order = order.view(rows, per_pack, num_packs)
    pack_load = torch.zeros(rows, num_packs, dtype=weight.dtype)
    members = torch.empty(rows, num_packs, per_pack, dtype=torch.int64)
    for j in range(per_pack):
        lightest = pack_load.argsort(dim=-1, stable=True)  # [rows, P] lightest first
        members[:, :, j].scatter_(1, lightest, order[:, j])
        pack_load.scatter_add_(1, lightest, sorted_w[:, j])
    return members


def _pair_swaps(weight_members: torch.Tensor, members: torch.Tensor) -> None:
    """Fast phase of the refinement, in place: each round pairs the i-th heaviest pack with the
    i-th lightest (disjoint pairs) and makes, in every pair, the one exchange of an item that
    lowers the pair's larger load most (if any). No pack's load rises above its pair's old
    maximum, so the heaviest pack never gets heavier."""
    rows, num_packs, per_pack = members.shape
    half = num_packs // 2
    m, mw = members.view(rows, -1), weight_members.view(rows, -1)
    offsets = torch.arange(per_pack)
    for _ in range(PAIR_ROUNDS):
        load = weight_members.sum(dim=-1)                               # [rows, P]
        order = load.argsort(dim=-1, descending=True)
        hi, lo = order[:, :half], order[:, num_packs - half:].flip(-1)  # [rows, half]
        pos_hi = (hi[..., None] * per_pack + offsets).view(rows, -1)    # [rows, half * k]
        pos_lo = (lo[..., None] * per_pack + offsets).view(rows, -1)
        w_hi = mw.gather(1, pos_hi).view(rows, half, per_pack)
        w_lo = mw.gather(1, pos_lo).view(rows, half, per_pack)
        load_hi, load_lo = load.gather(1, hi), load.gather(1, lo)
        delta = w_hi[..., :, None] - w_lo[..., None, :]                 # [rows, half, k, k]
        new_max = torch.maximum(load_hi[..., None, None] - delta, load_lo[..., None, None] + delta)
        best, flat = new_max.view(rows, half, -1).min(dim=-1)
        ok = best < load_hi * (1 - 1e-6)
        if not bool(ok.any()):
            return
        pos_a = (hi * per_pack + flat // per_pack)                      # [rows, half]
        pos_b = (lo * per_pack + flat % per_pack)
        item_a, item_b = m.gather(1, pos_a), m.gather(1, pos_b)
        w_a, w_b = mw.gather(1, pos_a), mw.gather(1, pos_b)
        m.scatter_(1, pos_a, torch.where(ok, item_b, item_a))
        m.scatter_(1, pos_b, torch.where(ok, item_a, item_b))
        mw.scatter_(1, pos_a, torch.where(ok, w_b, w_a))
        mw.scatter_(1, pos_b, torch.where(ok, w_a, w_b))


def _refine_by_swaps(weight: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Lower each row's heaviest pack by single item exchanges with other packs: each round,
    every row still improving makes the exchange between its heaviest pack and any other pack
    that minimises the larger of the two new loads; a row stops when no exchange lowers its
    heaviest pack (its loads cannot change after that, so it leaves the active set).

    weight [rows, n]; members [rows, P, k] item ids -> new members (same shape)."""
    rows, num_packs, per_pack = members.shape
    if per_pack == 1 or num_packs == 1:
        return members
    member_w = weight.gather(1, members.view(rows, -1)).view(rows, num_packs, per_pack)
    _pair_swaps(member_w, members)
    # a row whose heaviest pack is within NEAR_OPTIMAL of the lower bound (the mean pack
    # load, or the heaviest item) is done
    bound = torch.maximum(weight.sum(-1) / num_packs, weight.max(-1).values) * (1 + NEAR_OPTIMAL)
    active = torch.arange(rows)
    for _ in range(SWAP_ROUNDS):
        idx = torch.arange(active.numel())
        m_w = member_w[active]                                      # [a, P, k]
        load = m_w.sum(dim=-1)                                      # [a, P]
        heavy_load, heavy = load.max(dim=-1)                        # [a]
        # exchanging item x (heavy pack) with item y (pack p) moves delta = w_x - w_y
        delta = m_w[idx, heavy][:, None, :, None] - m_w[:, :, None, :]
        new_max = torch.maximum(heavy_load[:, None, None, None] - delta,
                                load[:, :, None, None] + delta)     # [a, P, k, k]
        new_max[idx, heavy] = float("inf")
        best, flat = new_max.view(active.numel(), -1).min(dim=-1)
        keep = (best < heavy_load * (1 - 1e-6)) & (heavy_load > bound[active])
        active, flat, heavy = active[keep], flat[keep], heavy[keep]
        if active.numel() == 0:
            break
        other, a, b = flat // (per_pack * per_pack), (flat // per_pack) % per_pack, flat % per_pack
        item_a, item_b = members[active, heavy, a], members[active, other, b]
        w_a, w_b = member_w[active, heavy, a], member_w[active, other, b]
        members[active, heavy, a], members[active, other, b] = item_b, item_a
        member_w[active, heavy, a], member_w[active, other, b] = w_b, w_a
    return members


def pack_balanced(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n weighted items into `num_packs` packs of exactly n / num_packs items each, the
    packs' loads as even as possible (greedy LPT, then swap refinement; see the module doc).

    Args:
        weight: [rows, n] float32.
    Returns:
        pack_index [rows, n] int64, rank_in_pack [rows, n] int64 (the item's slot in its pack).
    """
    rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs.")
    per_pack = n // num_packs
    if per_pack == 1:
        pack = torch.arange(n, dtype=torch.int64).expand(rows, n).clone()
        return pack, torch.zeros_like(pack)
    members = _refine_by_swaps(weight, _round_pack(weight, num_packs)).view(rows, n)
    slots = torch.arange(n, dtype=torch.int64).expand(rows, n)
    pack = torch.empty_like(members).scatter_(1, members, slots // per_pack)
    rank_in_pack = torch.empty_like(members).scatter_(1, members, slots % per_pack)
    return pack, rank_in_pack


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    return inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))


def _hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log, replica_rank, count) with groups packed to nodes first (module doc)."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    # 1. groups -> nodes; "mlog" numbers the logical experts node by node
    group_load = weight.view(layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = pack_balanced(group_load, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[..., None]
                + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2. replicas within each node: rows are (layer, node)
    mlog_load = weight.gather(-1, mlog2log).view(layers * num_nodes, -1)
    phy2mlog, phy_rank, mlog_count = replicate_experts(mlog_load, num_physical // num_nodes)
    # 3. replicas -> the node's GPUs
    replica_load = (mlog_load / mlog_count).gather(-1, phy2mlog)
    gpu, rank_in_gpu = pack_balanced(replica_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * per_gpu + rank_in_gpu)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (torch.arange(num_nodes) * (num_logical // num_nodes))[None, :, None]
                 ).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    replica_rank = phy_rank.gather(-1, pphy2phy).view(layers, -1)
    count = mlog_count.view(layers, -1).gather(-1, log2mlog)
    return phy2log, replica_rank, count


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A physical placement of the logical experts of every MoE layer.

    Args:
        weight: [layers, num_logical] loads (token counts; any real dtype, any device).
        num_replicas: physical experts per layer (num_logical + redundant), a multiple of
            num_gpus.
        num_groups: expert groups (DeepSeek-V3: 8); hierarchical policy when num_nodes divides
            it, global otherwise.
        num_nodes: nodes (fast links inside a node); divides num_gpus.
        num_gpus: EP ranks; physical experts [g * per_gpu, (g + 1) * per_gpu) live on rank g.
    Returns (CPU int64 tensors):
        physical_to_logical [layers, num_replicas]: the logical expert of each physical slot.
        logical_to_physical [layers, num_logical, max_count]: each logical expert's physical
            slots, -1 padded (max_count = the largest replica count).
        logical_replica_count [layers, num_logical]: replicas per logical expert (>= 1).
    Raises:
        ValueError: sizes that do not divide as described.
    """
    layers, num_logical = weight.shape
    if num_replicas % num_gpus or num_gpus % num_nodes:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus="
                         f"{num_gpus}, and num_gpus a multiple of num_nodes={num_nodes}.")
    if num_replicas < num_logical or num_logical % num_groups:
        raise ValueError(f"{num_logical} logical experts need num_replicas >= {num_logical} "
                         f"(got {num_replicas}) and must split into num_groups={num_groups}.")
    weight = weight.detach().float().cpu()
    hierarchical = (num_groups % num_nodes == 0 and num_logical % num_nodes == 0
                    and num_replicas % num_nodes == 0)
    if hierarchical:
        phy2log, replica_rank, count = _hierarchical(weight, num_replicas, num_groups,
                                                     num_nodes, num_gpus)
    else:
        phy2log, replica_rank, count = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_count = int(count.max())
    log2phy = torch.full((layers, num_logical, max_count), -1, dtype=torch.int64)
    log2phy.view(layers, -1).scatter_(
        -1, phy2log * max_count + replica_rank,
        torch.arange(num_replicas, dtype=torch.int64).expand(layers, -1))
    return phy2log, log2phy, count


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, count: torch.Tensor,
                 num_gpus: int) -> torch.Tensor:
    """Max / mean rank load per layer when each logical expert's load splits evenly over its
    replicas. weight [layers, num_logical], phy2log [layers, P], count [layers, num_logical]
    -> [layers] float32 (1.0 = perfectly even)."""
    weight = weight.float().cpu()
    replica_load = (weight / count).gather(-1, phy2log)             # [layers, P]
    rank_load = replica_load.view(weight.shape[0], num_gpus, -1).sum(-1)
    return rank_load.max(-1).values / rank_load.mean(-1).clamp_min(1e-12)
