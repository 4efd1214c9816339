"""Expert parallelism (EP) for the MoE layers of a model: routed experts split over the ranks of
a process group by a physical placement, tokens dispatched to the ranks holding their experts
and combined back with `all_to_all_single`; device-side expert load counters over a sliding
window; EPLB rebalancing: a new placement decided at a step boundary, the expert weights
moved between ranks in the background while later steps run on the old placement, committed at
a later step boundary (engine/moe/weight_moves.py).

Placement (per MoE layer): P = num_experts + num_redundant physical slots, rank r holds slots
[r * P / world, (r + 1) * P / world) (its `w13` / `w2` rows); `phys2log[p]` is the logical
expert in slot p; a logical expert's replicas are `log2phy[e, :count[e]]`. Each (token, k) pair
of a replicated expert goes to replica `pair_index % count[e]` (spread evenly, deterministic).

One MoE forward on every rank (DESIGN: attention DP + EP, as DeepSeek-V3 §3.4 / DeepEP's
normal mode, written over plain torch.distributed):
1. route locally (`select_experts`), count the logical choices into the step's load counters;
2. pairs sorted by destination rank; the per-rank counts are exchanged (all_to_all of [world]
   int64), then the hidden rows and their local expert slot travel (all_to_all_single);
3. each rank runs its experts on what it received (`kernels.moe.moe_experts`, weight 1);
4. the outputs travel back by the reversed split sizes, are put back in pair order, weighted
   and summed per token (float32) — shared experts and attention never leave the rank.
Ranks without tokens (attention DP idle ranks) still call every layer's collectives with zero
rows (`run_idle_step`), so the collectives line up.

With world size 1 (no group) the same placement, replica choice and counters run, with no
collective (the single-GPU EP code path).

The MTP layers' MoE stay local (all experts on every rank): they run only when a drafter asks,
which ranks do not do in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.engine.moe.eplb import rebalance_experts
from deepinfer.engine.moe.gating import select_experts
from deepinfer.engine.moe.weight_moves import PendingMove, keep_slots, start_move
from deepinfer.kernels.moe import moe_experts

__all__ = ["EPGroup", "ExpertLoadRecorder", "ExpertParallel", "enable_expert_parallel"]


@dataclass(frozen=True)
class EPGroup:
    """The EP ranks: `group` None means one rank (no collectives). `move_group`: the process
    group EPLB's weight moves use (point-to-point, in the background); None = `group`."""

    rank: int = 0
    world: int = 1
    group: object | None = None
    move_group: object | None = None


class ExpertLoadRecorder:
    """Per-layer logical expert loads, counted on the device with no host sync.

    `step_load` [layers, num_experts] int64 is what the MoE layers add their routing choices to
    during a step (each layer holds a row view; fixed addresses, so CUDA graphs can hold them);
    `end_step()` moves it into slot `step % window_steps` of `window` [window_steps, layers,
    num_experts] int64 and zeroes it; `window_load()` is the sum over the window.
    """

    def __init__(self, num_layers: int, num_experts: int, window_steps: int,
                 device: torch.device):
        self.step_load = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.window = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64,
                                  device=device)
        self.num_steps = 0

    def end_step(self) -> None:
        self.window[self.num_steps % self.window.shape[0]].copy_(self.step_load)
        self.step_load.zero_()
        self.num_steps += 1

    def window_load(self) -> torch.Tensor:
        """[layers, num_experts] int64 on the device: loads of the last window_steps steps."""
        return self.window.sum(dim=0)


def _all_to_all(tensor: torch.Tensor, send: list[int], recv: list[int], ep: EPGroup
                ) -> torch.Tensor:
    out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=ep.group)
    return out


class ExpertParallelMoE:
    """The EP state of one MoE layer (`MoE.expert_parallel`): its placement buffers on the
    device and its row of the load counters.

    log2phy: [num_experts, num_redundant + 1] int64, -1 padded; count: [num_experts] int64;
    phys2log: [P] int64 on the CPU (the placement, the same on every rank).
    """

    def __init__(self, moe, ep: EPGroup, phys2log: torch.Tensor, load: torch.Tensor,
                 max_replicas: int):
        self.ep, self.load = ep, load
        self.num_physical = phys2log.numel()
        self.per_rank = self.num_physical // ep.world
        self.max_replicas = max_replicas
        self.phys2log = phys2log.clone()
        device = moe.gate_weight.device
        self.log2phy = torch.full((moe.routing.num_experts, max_replicas), -1,
                                  dtype=torch.int64, device=device)
        self.count = torch.zeros(moe.routing.num_experts, dtype=torch.int64, device=device)
        self._set_maps(phys2log)
        self.deep_ep = None   # a DeepEPDispatcher with ep_backend "deep_ep"

    def _set_maps(self, phys2log: torch.Tensor) -> None:
        """Rebuild log2phy / count from a placement [P] (replicas in slot order)."""
        num_experts = self.count.numel()
        count = torch.bincount(phys2log, minlength=num_experts)
        order = torch.sort(phys2log, stable=True).indices                 # slots by expert
        first = torch.cumsum(count, 0) - count
        rank = torch.arange(phys2log.numel()) - first[phys2log[order]]
        log2phy = torch.full((num_experts, self.max_replicas), -1, dtype=torch.int64)
        log2phy[phys2log[order], rank] = order
        self.log2phy.copy_(log2phy)
        self.count.copy_(count)
        self.phys2log = phys2log.clone()

    def forward(self, moe, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> the routed experts' weighted sum [T, hidden_size]."""
        if hidden.shape[0] == 0:   # an idle rank: no routing (grouped top-k needs rows)
            top_k = moe.routing.top_k
            topk_weights = torch.empty(0, top_k, dtype=torch.float32, device=hidden.device)
            topk_ids = torch.empty(0, top_k, dtype=torch.int64, device=hidden.device)
        else:
            router_logits = hidden.float() @ moe.gate_weight.T
            topk_weights, topk_ids = select_experts(router_logits, moe.routing,
                                                    moe.e_score_correction_bias)
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        self.load.index_add_(0, flat_ids, torch.ones_like(flat_ids))
        pair = torch.arange(flat_ids.numel(), device=flat_ids.device)
        physical = self.log2phy[flat_ids, pair % self.count[flat_ids]]     # [T * k]
        if self.ep.world == 1:
            return moe_experts(hidden, moe.w13, moe.w2, topk_weights,
                               physical.view(num_tokens, top_k), backend=moe.backend,
                               settings=moe.kernel_config, w13_scale=moe.w13_scale,
                               w2_scale=moe.w2_scale)
        if self.deep_ep is not None:   # engine/moe/ep_backends.py
            return self.deep_ep.forward(moe, hidden, topk_weights,
                                        physical.view(num_tokens, top_k))
        return self._dispatch_combine(moe, hidden, topk_weights, physical)

    def _dispatch_combine(self, moe, hidden: torch.Tensor, topk_weights: torch.Tensor,
                          physical: torch.Tensor) -> torch.Tensor:
        x, slot, route = self.dispatch(hidden, physical, topk_weights.shape[1])
        if x.shape[0]:
            y = moe_experts(x, moe.w13, moe.w2, torch.ones(x.shape[0], 1, device=x.device),
                            slot[:, None], backend=moe.backend, settings=moe.kernel_config,
                            w13_scale=moe.w13_scale, w2_scale=moe.w2_scale)
        else:
            y = x
        return self.combine(y, route, topk_weights, hidden.dtype)

    def dispatch(self, hidden: torch.Tensor, physical: torch.Tensor, top_k: int):
        """Send each (token, k) pair's row to the rank holding its physical slot (steps 2 of
        the module doc). hidden [T, H], physical [T * top_k] int64 slots -> (x [R, H] the rows
        this rank received, slot [R] int64 their local slot, route: what `combine` needs).
        Collective over the EP group (host sync on the split sizes)."""
        ep = self.ep
        dest = physical // self.per_rank
        order = torch.sort(dest, stable=True).indices
        send_counts = torch.bincount(dest, minlength=ep.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        x = _all_to_all(hidden[order // top_k], send, recv, ep)
        slot = _all_to_all((physical % self.per_rank)[order], send, recv, ep)
        return x, slot, (order, send, recv)

    def combine(self, y: torch.Tensor, route, topk_weights: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Send the expert outputs y [R, H] back (reversed splits), restore pair order, weight
        by topk_weights [T, top_k] float32 and sum per token (float32) -> [T, H] `dtype`.
        Collective over the EP group."""
        order, send, recv = route
        top_k = topk_weights.shape[1]
        back = _all_to_all(y, recv, send, self.ep)
        pairs = torch.empty(back.shape, dtype=torch.float32, device=back.device)
        pairs[order] = back.float()
        out = (pairs.view(-1, top_k, pairs.shape[-1]) * topk_weights[..., None]).sum(dim=1)
        return out.to(dtype)

    def idle(self, moe) -> None:
        """Take part in this layer's collectives with no tokens (an idle attention-DP rank)."""
        hidden = torch.empty(0, moe.gate_weight.shape[1], dtype=moe.dtype,
                             device=moe.w13.device)
        self.forward(moe, hidden)


class ExpertParallel:
    """EP over all decoder MoE layers of a model, plus the load counters and EPLB.

    Args:
        model: a built model with its full expert weights loaded (MoE modules with `routing`).
        ep: the EP ranks.
        num_redundant: extra physical slots per layer; num_experts + it must divide by world.
        window_steps: load counter window (steps).
        num_nodes: for EPLB's hierarchical policy.
        ep_backend: the resolved dispatch/combine backend, "all_to_all" or "deep_ep"
            (engine/moe/ep_backends.py `resolve_ep_backend`).
    The initial placement puts slot p on expert p % num_experts (replicas of the first
    experts); each rank keeps only its slots' weights.
    """

    def __init__(self, model: torch.nn.Module, ep: EPGroup, num_redundant: int = 0,
                 window_steps: int = 1000, num_nodes: int = 1, ep_backend: str = "all_to_all"):
        self.ep, self.num_nodes = ep, num_nodes
        self.moes = decoder_moes(model)
        if not self.moes:
            raise ValueError("expert parallelism needs a model with MoE layers; this one has "
                             "none (drop --enable-expert-parallel).")
        routing = self.moes[0].routing
        self.num_experts = routing.num_experts
        self.num_groups = routing.n_group if routing.topk_method != "greedy" else 1
        self.num_physical = self.num_experts + num_redundant
        if self.num_physical % ep.world:
            raise ValueError(f"{self.num_experts} experts + {num_redundant} redundant do not "
                             f"split evenly over {ep.world} EP ranks; change "
                             "--num-redundant-experts.")
        device = self.moes[0].gate_weight.device
        self.loads = ExpertLoadRecorder(len(self.moes), self.num_experts, window_steps, device)
        per = self.num_physical // ep.world
        phys2log = torch.arange(self.num_physical) % self.num_experts
        mine = phys2log[ep.rank * per:(ep.rank + 1) * per].to(device)
        for i, moe in enumerate(self.moes):
            keep_slots(moe, mine)   # weights, and FP8 experts' block scales
            moe.expert_parallel = ExpertParallelMoE(moe, ep, phys2log, self.loads.step_load[i],
                                                    num_redundant + 1)
        if ep_backend == "deep_ep" and ep.world > 1:
            from deepinfer.engine.moe.ep_backends import DeepEPDispatcher

            dispatcher = DeepEPDispatcher(ep.group, self.moes[0].gate_weight.shape[1],
                                          self.num_physical)
            for moe in self.moes:
                moe.expert_parallel.deep_ep = dispatcher
        self.num_rebalances = 0
        self.pending_move: PendingMove | None = None
        self.move_stats: list[dict] = []   # per committed move: steps, bytes, seconds

    def placement(self) -> torch.Tensor:
        """[layers, P] int64: the current physical -> logical map."""
        return torch.stack([moe.expert_parallel.phys2log for moe in self.moes])

    def run_idle_step(self) -> None:
        """Every EP layer's collectives with zero tokens, in forward order."""
        with torch.inference_mode():
            for moe in self.moes:
                moe.expert_parallel.idle(moe)

    def end_step(self) -> None:
        self.loads.end_step()

    @property
    def move_pending(self) -> bool:
        return self.pending_move is not None

    def start_rebalance(self, step: int = 0) -> torch.Tensor:
        """EPLB: sum the window's loads over the ranks, compute a new placement
        (`rebalance_experts`, the same on every rank) and start moving the weights
        (engine/moe/weight_moves.py); the old placement serves until `commit_if_moved`
        commits. One rank: the move commits at once. A move still in flight is finished
        first. Collective. Returns the new placement [layers, P]."""
        if self.pending_move is not None:
            self._commit(step)
        load = self.loads.window_load()
        if self.ep.world > 1:
            dist.all_reduce(load, group=self.ep.group)
        groups = self.num_groups if self.num_experts % max(self.num_groups, 1) == 0 else 1
        nodes = self.num_nodes if self.ep.world % self.num_nodes == 0 else 1
        phys2log, _, _ = rebalance_experts(load.cpu(), self.num_physical, groups, nodes,
                                           self.ep.world)
        with torch.inference_mode():
            self.pending_move = start_move(
                self.moes, [moe.expert_parallel.phys2log for moe in self.moes], phys2log,
                self.ep.rank, self.ep.world, self.ep.move_group or self.ep.group, step)
        self.num_rebalances += 1
        if self.ep.world == 1:
            self._commit(step)
        return phys2log

    def commit_if_moved(self, step: int) -> bool:
        """At a step boundary with a move in flight: commit it when every rank's transfers
        finished (all-reduce MIN of the ranks' flags over the EP group, so all commit at the
        same boundary). Collective. Returns whether it committed."""
        if self.pending_move is None:
            return False
        done = torch.tensor([int(self.pending_move.locally_done())],
                            device=self.loads.step_load.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.ep.group)
        if not bool(done.item()):
            return False
        self._commit(step)
        return True

    def _commit(self, step: int) -> None:
        move, self.pending_move = self.pending_move, None
        with torch.inference_mode():
            move.commit(self.moes, _set_maps, in_place=self.ep.world == 1)
        move.stats.update(decision_step=move.decision_step, commit_step=step)
        self.move_stats.append(move.stats)

    def rebalance(self) -> torch.Tensor:
        """`start_rebalance` and wait for the move to commit (blocking; benchmarks)."""
        phys2log = self.start_rebalance()
        if self.pending_move is not None:
            self._commit(0)
        return phys2log


def _set_maps(moe, phys2log: torch.Tensor) -> None:
    moe.expert_parallel._set_maps(phys2log)


def decoder_moes(model: torch.nn.Module) -> list:
    """The MoE modules of the decoder layers (not MTP), in forward order."""
    layers = getattr(model, "layers", [])
    return [layer.mlp.moe for layer in layers
            if hasattr(getattr(layer, "mlp", None), "moe")]


def enable_expert_parallel(model: torch.nn.Module, ep: EPGroup, num_redundant: int = 0,
                           window_steps: int = 1000, num_nodes: int = 1,
                           ep_backend: str = "all_to_all") -> ExpertParallel:
    """Split `model`'s routed experts over `ep` (see `ExpertParallel`)."""
    return ExpertParallel(model, ep, num_redundant, window_steps, num_nodes, ep_backend)
