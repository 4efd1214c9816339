"""Moving routed expert weights to a new EPLB placement, in the background.

A rebalance (engine/moe/expert_parallel.py) decides a new physical placement at a step
boundary. `start_move` then, on every EP rank at the same step:
1. plans each layer that changes (`plan_sources`): every new slot of a rank takes its expert's
   weights from the slot itself when it keeps its expert, else from a slot of the same rank
   that holds that expert now, else from the first rank that holds it now;
2. copies the rank-local sources into staging tensors (one new [per_rank, ...] tensor per
   weight per changed layer) right away;
3. packs, per peer rank, every row it sends (all changed layers, in (layer, new slot) order:
   both sides derive the same order from the two placements, which every rank knows) into one
   byte buffer, and posts one isend + one irecv per peer (`batch_isend_irecv`, on a process
   group of its own so the transfers never interleave with the dispatch/combine collectives).
The ranks keep running steps with the old placement and the old weights (untouched: the
sends read packed copies, the staging tensors are new), so outputs do not change while the
move is in flight. At each later step boundary `PendingMove.locally_done()` says whether this
rank's transfers finished (gloo: a helper thread waits on the works, since a gloo send/recv
work only completes in `wait()`, and then unpacks the received rows into the staging tensors;
NCCL: `Work.is_completed()`, the rows unpacked at the commit); the caller agrees on it over
the EP group (all-reduce MIN) and, when every rank is done, `commit()` swaps the staging
tensors in (`moe.w13` / `moe.w2` / FP8 scales point at
the new tensors) together with the new maps.

Memory: the staging tensors hold a changed layer's expert weights a second time until the
commit (the old ones are freed then). Rows travel as raw bytes (FP8 weights and their float32
scales alike).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

WEIGHT_NAMES = ("w13", "w2", "w13_scale", "w2_scale")


def plan_sources(old_phys2log: torch.Tensor, new_phys2log: torch.Tensor, world: int
                 ) -> torch.Tensor:
    """Where each new slot's weights come from.

    Args:
        old_phys2log, new_phys2log: [P] int64 logical expert per physical slot (rank r holds
            slots [r * P / world, (r + 1) * P / world)).
    Returns:
        src_slot [P] int64: an old slot holding the new slot's expert: the slot itself when it
        keeps its expert, else one on the destination rank, else the lowest old slot of it.
    """
    num_slots = old_phys2log.numel()
    per = num_slots // world
    num_experts = int(torch.maximum(old_phys2log.max(), new_phys2log.max())) + 1
    slots = torch.arange(num_slots)
    rank_of = slots // per
    # the highest old slot of expert e on rank r (-1: r does not hold e)
    on_rank = torch.full((world * num_experts,), -1, dtype=torch.int64)
    on_rank.scatter_reduce_(0, rank_of * num_experts + old_phys2log, slots, reduce="amax")
    anywhere = torch.full((num_experts,), num_slots, dtype=torch.int64)
    anywhere.scatter_reduce_(0, old_phys2log, slots, reduce="amin")
    local = on_rank[rank_of * num_experts + new_phys2log]
    src = torch.where(local >= 0, local, anywhere[new_phys2log])
    if bool((src >= num_slots).any()):
        raise ValueError("the new placement holds an expert the old one does not; every "
                         "placement must hold every logical expert.")
    return torch.where(old_phys2log == new_phys2log, slots, src)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[per_rank, ...] any dtype -> [per_rank, bytes] uint8 view."""
    return tensor.contiguous().view(tensor.shape[0], -1).view(torch.uint8)


@dataclass
class LayerMove:
    """One changed layer: its new placement and staging tensors (name -> [per_rank, ...])."""

    index: int
    new_phys2log: torch.Tensor
    staging: dict[str, torch.Tensor]


@dataclass
class PendingMove:
    """A move in flight (module doc). `recv` [(buffer [rows, bytes] uint8, [(position in
    `layers`, local slot)] per row)] says where each received row goes; `stats` the timings
    (s) and bytes, filled as it goes."""

    layers: list[LayerMove]
    works: list
    recv: list
    decision_step: int
    background: bool
    sending: list = field(default_factory=list)   # the send buffers, alive until the commit
    stats: dict = field(default_factory=dict)
    _done: threading.Event = field(default_factory=threading.Event)
    _error: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stats["posted_at"] = time.perf_counter()
        if not self.works:
            self._finish_wait()
        elif self.background:
            threading.Thread(target=self._wait_all, name="eplb-move", daemon=True).start()

    def _wait_all(self) -> None:
        try:
            for work in self.works:
                work.wait()
            self._unpack()   # off the step loop too: the staging tensors are not in use yet
        except BaseException as exc:   # noqa: BLE001 - raised by commit() on the step loop
            self._error.append(exc)
        self._finish_wait()

    def _unpack(self) -> None:
        """Copy the received rows into the staging tensors (once)."""
        for buffer, where in self.recv:
            for row, (position, slot) in zip(buffer, where):
                _unpack_row(row, self.layers[position].staging, slot)
        self.recv = []

    def _finish_wait(self) -> None:
        self.stats["transfer_s"] = time.perf_counter() - self.stats["posted_at"]
        self._done.set()

    def locally_done(self) -> bool:
        """Whether this rank's sends and receives finished (no blocking)."""
        if not self.background and not self._done.is_set():
            if all(work.is_completed() for work in self.works):
                self._finish_wait()
        return self._done.is_set()

    def wait(self) -> None:
        """Block until this rank's transfers finished; the blocked time goes to stats."""
        start = time.perf_counter()
        if self.background:
            self._done.wait()
        elif not self._done.is_set():
            for work in self.works:
                work.wait()
            self._finish_wait()
        self.stats["blocked_s"] = self.stats.get("blocked_s", 0.0) + time.perf_counter() - start
        if self._error:
            raise RuntimeError(f"an expert weight move failed: {self._error[0]}; the EP ranks "
                               "are out of step, the engine stops.") from self._error[0]

    def commit(self, moes: list, set_maps, *, in_place: bool) -> None:
        """Unpack the received rows, swap the staging tensors in (`in_place`: copy them into
        the current tensors instead, keeping their addresses for captured CUDA graphs), apply
        the new maps (`set_maps(moe, new_phys2log)`). Every EP rank at the same step
        boundary."""
        self.wait()
        self._unpack()
        for layer in self.layers:
            moe = moes[layer.index]
            for name, tensor in layer.staging.items():
                if in_place:
                    getattr(moe, name).data.copy_(tensor)
                    continue
                if isinstance(getattr(moe, name), torch.nn.Parameter):
                    tensor = torch.nn.Parameter(tensor, requires_grad=False)
                setattr(moe, name, tensor)
            set_maps(moe, layer.new_phys2log)


def _weights(moe) -> dict[str, torch.Tensor]:
    """The layer's per-slot tensors (FP8 scales when present), name -> [per_rank, ...]."""
    return {name: getattr(moe, name).data for name in WEIGHT_NAMES
            if getattr(moe, name, None) is not None}


def keep_slots(moe, slots: torch.Tensor) -> None:
    """Replace each per-slot tensor of the layer (WEIGHT_NAMES present) by its rows `slots`
    ([n] int64 indices on the tensors' device): the rank's share at placement time. Parameters
    stay Parameters."""
    for name, tensor in _weights(moe).items():
        rows = tensor[slots].clone()
        if isinstance(getattr(moe, name), torch.nn.Parameter):
            rows = torch.nn.Parameter(rows, requires_grad=False)
        setattr(moe, name, rows)


def _pack_row(weights: dict[str, torch.Tensor], slot: int) -> torch.Tensor:
    """One slot's tensors as one uint8 row [bytes]."""
    return torch.cat([_rows(t[slot:slot + 1])[0] for t in weights.values()])


def _unpack_row(row: torch.Tensor, staging: dict[str, torch.Tensor], slot: int) -> None:
    offset = 0
    for tensor in staging.values():
        dest = _rows(tensor[slot:slot + 1])[0]
        dest.copy_(row[offset:offset + dest.numel()])
        offset += dest.numel()


def start_move(moes: list, old: list[torch.Tensor], new: torch.Tensor, rank: int, world: int,
               group, decision_step: int) -> PendingMove:
    """Plan and post the move of every changed layer to the placement `new` [layers, P]
    (module doc); `old[i]` is layer i's current placement [P]. Collective over `group` (all
    EP ranks call it at the same step with the same placements)."""
    per = new.shape[1] // world
    layers: list[LayerMove] = []
    send: dict[int, list[torch.Tensor]] = {}
    recv_where: dict[int, list[tuple[int, int]]] = {}
    row_bytes = 0
    for index, (moe, layer_old, layer_new) in enumerate(zip(moes, old, new)):
        if torch.equal(layer_old, layer_new):
            continue
        src = plan_sources(layer_old, layer_new, world).tolist()
        weights = _weights(moe)
        staging = {name: torch.empty(t.shape, dtype=t.dtype, device=t.device)   # contiguous
                   for name, t in weights.items()}
        position = len(layers)
        layers.append(LayerMove(index, layer_new.clone(), staging))
        row_bytes = sum(_rows(t[:1]).shape[1] for t in weights.values())
        for slot, source in enumerate(src):
            src_rank, dst_rank = source // per, slot // per
            if dst_rank == rank == src_rank:
                for name, t in weights.items():
                    staging[name][slot % per].copy_(t[source % per])
            elif src_rank == rank:
                send.setdefault(dst_rank, []).append(_pack_row(weights, source % per))
            elif dst_rank == rank:
                recv_where.setdefault(src_rank, []).append((position, slot % per))
    device = moes[0].w13.device
    ops, recv, sending = [], [], []
    for peer in range(world):
        if peer in send:
            sending.append(torch.stack(send[peer]))
            ops.append(dist.P2POp(dist.isend, sending[-1], peer, group))
        if peer in recv_where:
            buffer = torch.empty(len(recv_where[peer]), row_bytes, dtype=torch.uint8,
                                 device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group))
            recv.append((buffer, recv_where[peer]))
    works = dist.batch_isend_irecv(ops) if ops else []
    move = PendingMove(layers, works, recv, decision_step, background=device.type != "cuda",
                       sending=sending)
    move.stats["bytes_sent"] = sum(len(rows) for rows in send.values()) * row_bytes
    move.stats["bytes_received"] = sum(len(w) for w in recv_where.values()) * row_bytes
    return move
