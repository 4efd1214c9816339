"""The DeepSeek MTP drafter: a checkpoint's multi-token-prediction module (DeepSeek-V3 report
§2.2; `DeepseekForCausalLM.mtp_forward`) reused autoregressively for gamma drafts.

Runs inside the model runner after each step (`after_step`, called by
`ModelRunner.execute_and_score`), on the step's own hidden states:
1. fill: MTP module 0 over every token the step computed, row t combining the main model's
   hidden h_p with the embedding of the token at p + 1 (the committed one; 0 past the committed
   length), which writes the module's latent KV at every computed position (its attention
   needs the whole context, like the main layers');
2. chain: for each request that sampled, its row at the last committed position gives the
   logits of draft 1 (the token after the newest committed token); draft j + 1 comes from the
   module again at the next position, fed its own output hidden and the embedding of draft j.
   Drafts are the argmax of each step (deterministic, so a confidence computed from the step's
   distribution never depends on the draft itself). The chain writes the module's latent at
   positions past the committed length: into the request's own blocks where they reach, else
   into scratch blocks the drafter appends to the MTP layer's cache (never handed to the
   scheduler); step 1 of a later step overwrites them with committed tokens' values.

Confidence: c_j = sigmoid(logit(q_j) / T_j), q_j the draft's probability under the module's
softmax at draft position j, T_j fitted online per position on the observed acceptances
(`PositionTemperatures`, the paper's sequential temperature scaling reduced to per-position
temperature scaling on the conditional outcomes, by log loss over a grid).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.engine.input_batch import CachedRequestState, StepInputs, build_step_inputs
from deepinfer.engine.spec.drafter import DraftProposal, DraftRequest, observed_positions

TEMPERATURE_GRID = [round(0.05 * i, 2) for i in range(1, 101)]   # 0.05 .. 5.00
REFIT_EVERY = 64            # observations per position between refits
WINDOW = 4096               # observations kept per position


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class PositionTemperatures:
    """Per-position temperature scaling of draft probabilities, fitted online by log loss."""

    def __init__(self, num_positions: int):
        self.temperatures = [1.0] * num_positions
        self._seen = [deque(maxlen=WINDOW) for _ in range(num_positions)]
        self._since_fit = [0] * num_positions

    def confidence(self, position: int, draft_prob: float) -> float:
        return 1.0 / (1.0 + math.exp(-_logit(draft_prob) / self.temperatures[position]))

    def add(self, position: int, draft_prob: float, accepted: bool) -> None:
        self._seen[position].append((_logit(draft_prob), accepted))
        self._since_fit[position] += 1
        if self._since_fit[position] >= REFIT_EVERY:
            self._since_fit[position] = 0
            self.temperatures[position] = self.fit(self._seen[position])

    @staticmethod
    def fit(observations) -> float:
        """The grid temperature of least log loss (ties: the one closest to 1)."""
        logits = np.array([x for x, _ in observations])
        labels = np.array([y for _, y in observations], dtype=np.float64)
        best, best_loss = 1.0, float("inf")
        for t in sorted(TEMPERATURE_GRID, key=lambda t: abs(t - 1.0)):
            p = 1.0 / (1.0 + np.exp(-logits / t))
            p = np.clip(p, 1e-9, 1 - 1e-9)
            loss = -float(np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
            if loss < best_loss - 1e-12:
                best, best_loss = t, loss
        return best


class CalibratedModelDrafter:
    """The engine side of the drafters that run a model after each step (MTP, draft model;
    engine/spec/drafter.py's interface): the drafts `after_step` stored per request (`_drafts`:
    id -> (the request's token count then, draft ids, their probabilities q)) are proposed with
    calibrated confidences, and the verify outcomes refit the per-position temperatures.

    Args:
        num_speculative_tokens: gamma (positions calibrated).
    """

    def __init__(self, num_speculative_tokens: int):
        self.calibration = PositionTemperatures(num_speculative_tokens)
        self._drafts: dict[str, tuple[int, list[int], list[float]]] = {}  # id -> (len, ids, q)
        self._last: dict[str, list[float]] = {}   # id -> q of the drafts last proposed

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, DraftProposal]:
        proposals = {}
        for request in requests:
            stored = self._drafts.pop(request.request_id, None)
            if stored is None or stored[0] != len(request.token_ids):
                continue   # drafted for another state of the request (preempted, stopped)
            _, ids, probs = stored
            count = min(len(ids), request.max_drafts)
            if count <= 0:
                continue
            self._last[request.request_id] = probs[:count]
            proposals[request.request_id] = DraftProposal(ids[:count], [
                self.calibration.confidence(j, q) for j, q in enumerate(probs[:count])])
        return proposals

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        probs = self._last.pop(request_id, None)
        if probs is None:
            return
        for position, accepted in observed_positions(num_verified, num_accepted):
            self.calibration.add(position, probs[position], accepted)

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
        self._last.pop(request_id, None)


class MTPDrafter(CalibratedModelDrafter):
    """Args:
        model: a `DeepseekForCausalLM` with at least one MTP module.
        runner: its ModelRunner (the drafter registers itself as `runner.drafter`).
        num_speculative_tokens: gamma.
        max_num_seqs: requests per step (sizes the scratch blocks).
    """

    def __init__(self, model, runner, num_speculative_tokens: int, max_num_seqs: int = 256):
        if getattr(model, "num_mtp_layers", 0) < 1:
            raise ValueError("speculative_method=mtp needs a checkpoint with an MTP module "
                             "(num_nextn_predict_layers >= 1 and its weights); this model has "
                             "none. Use speculative_method=ngram.")
        super().__init__(num_speculative_tokens)
        self.model, self.runner = model, runner
        self.gamma = num_speculative_tokens
        self.layer = model.num_hidden_layers
        block_size = runner.block_size
        self._scratch_per_row = -(-(num_speculative_tokens + 1) // block_size) + 1
        cache = runner.kv_caches[self.layer]
        self._first_scratch = cache.shape[0]
        extra = torch.zeros((self._scratch_per_row * max_num_seqs, *cache.shape[1:]),
                            dtype=cache.dtype, device=cache.device)
        runner.kv_caches[self.layer] = torch.cat([cache, extra])   # blocks first (MLA layout)
        runner.drafter = self

    # ---- the runner side -------------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, inputs: StepInputs, hidden: torch.Tensor,
                   states: list[CachedRequestState]) -> None:
        """Fill the MTP cache over the step's tokens and draft for the rows that sampled.

        Args:
            inputs: the step's batch (host arrays; `on_device()` gives the metadata).
            hidden: [num_tokens, hidden_size] the main model's final hidden states.
            states: the scheduled requests in batch order, committed tokens already appended.
        """
        device = hidden.device
        positions = inputs.positions
        starts = inputs.query_start_loc
        next_ids = np.zeros(positions.size, dtype=np.int64)
        for row, state in enumerate(states):
            begin, end = int(starts[row]), int(starts[row + 1])
            known = len(state.token_ids)
            for t in range(begin, end):
                if positions[t] + 1 < known:
                    next_ids[t] = state.token_ids[positions[t] + 1]
        device_inputs = inputs.on_device()
        logits, mtp_hidden = self.model.mtp_forward(
            hidden, torch.from_numpy(next_ids).to(device), device_inputs.positions,
            self.runner.kv_caches, device_inputs.attn_metadata)
        sampling = {id(s) for s in inputs.sampling_states}
        rows, last_positions, chain_states = [], [], []
        for row, state in enumerate(states):
            if id(state) not in sampling:
                continue
            last = len(state.token_ids) - 2   # the position before the newest committed token
            index = int(starts[row]) + last - int(positions[int(starts[row])])
            if not int(starts[row]) <= index < int(starts[row + 1]):
                continue
            rows.append(index)
            last_positions.append(last)
            chain_states.append(state)
        if rows:
            self._chain(chain_states, last_positions, logits[rows], mtp_hidden[rows])

    def _chain(self, states: list[CachedRequestState], last_positions: list[int],
               logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """gamma drafts per request from draft 1's logits [R, V] and module hidden [R, H]."""
        drafts = [[] for _ in states]
        probs = [[] for _ in states]
        for j in range(self.gamma):
            q = logits.float().softmax(dim=-1)
            top_prob, top_ids = q.max(dim=-1)
            ids = top_ids.tolist()
            for r, (token, prob) in enumerate(zip(ids, top_prob.tolist())):
                drafts[r].append(token)
                probs[r].append(prob)
            if j + 1 == self.gamma:
                break
            inputs = self._chain_inputs(states, [p + 1 + j for p in last_positions], ids)
            device_inputs = inputs.on_device()
            logits, hidden = self.model.mtp_forward(
                hidden, top_ids, device_inputs.positions, self.runner.kv_caches,
                device_inputs.attn_metadata)
        for state, ids, qs in zip(states, drafts, probs):
            self._drafts[state.request_id] = (len(state.token_ids), ids, qs)

    def _chain_inputs(self, states: list[CachedRequestState], positions: list[int],
                      token_ids: list[int]) -> StepInputs:
        return chain_inputs(states, positions, token_ids, self.runner.block_size,
                            self.runner.device, self._first_scratch, self._scratch_per_row)


def chain_inputs(states: list[CachedRequestState], positions: list[int], token_ids: list[int],
                 block_size: int, device: torch.device, first_scratch: int,
                 scratch_per_row: int) -> StepInputs:
    """One-token rows (token_ids[r] at positions[r]) over each request's block table, extended
    past its end with row r's scratch blocks (ids first_scratch + r * scratch_per_row + i), so
    a draft chain can write KV past the blocks the scheduler allocated."""
    fake = []
    for r, (state, position) in enumerate(zip(states, positions)):
        scratch = [first_scratch + r * scratch_per_row + i for i in range(scratch_per_row)]
        table = (list(state.block_ids) + scratch)[:position // block_size + 1]
        fake.append(CachedRequestState(state.request_id, [0] * position + [token_ids[r]],
                                       position, table, position, state.sampling_params,
                                       state.seed))
    return build_step_inputs(fake, [1] * len(fake), block_size, device)
