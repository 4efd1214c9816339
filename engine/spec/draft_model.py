"""The draft-model drafter: a small model with the target's tokenizer drafts gamma tokens
greedily, with its own paged KV cache indexed by the target's block tables (same block size,
same block ids: one more "KV group" the scheduler never sees).

Runs inside the model runner after each step (`after_step`, like engine/spec/mtp.py):
1. fill: the draft model runs over the step's own tokens with the step's attention metadata,
   writing its KV at every position the target computed (rows of rejected drafts included:
   those positions are past the committed length and the next fill overwrites them);
2. chain: for each request that sampled, the newest committed token, then each draft, one
   token per forward, greedy; past the request's allocated blocks into scratch blocks of the
   draft cache (blocks num_blocks.., never handed to the scheduler).

Confidence: the draft probability calibrated online per position by temperature scaling
(`PositionTemperatures`, as for mtp).
"""

from __future__ import annotations

import torch

from deepinfer.engine.input_batch import CachedRequestState, StepInputs
from deepinfer.engine.spec.mtp import CalibratedModelDrafter, chain_inputs


class DraftModelDrafter(CalibratedModelDrafter):
    """Args:
        draft_model: a deepinfer model (engine/models) on the runner's device and dtype.
        runner: the target's ModelRunner (the drafter registers itself as `runner.drafter`).
        num_speculative_tokens: gamma.
        max_num_seqs: requests per step (sizes the scratch blocks).
    Raises:
        ValueError: the draft model's vocabulary differs from the target's.
    """

    def __init__(self, draft_model, runner, num_speculative_tokens: int, max_num_seqs: int = 256):
        target_vocab = runner.model.vocab_size
        if draft_model.vocab_size != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_model.vocab_size} ids) differs "
                             f"from the target's ({target_vocab}); speculative_model must share "
                             "the target's tokenizer.")
        super().__init__(num_speculative_tokens)
        self.model, self.runner = draft_model, runner
        self.gamma = num_speculative_tokens
        block_size = runner.block_size
        self._scratch_per_row = -(-(num_speculative_tokens + 1) // block_size) + 1
        self._first_scratch = runner.kv_caches[0].shape[runner.kv_block_dim]
        dtype = runner.kv_caches[0].dtype
        spec = draft_model.kv_cache_spec(dtype.itemsize)
        shape = spec.kv_cache_shape(self._first_scratch + self._scratch_per_row * max_num_seqs,
                                    block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=runner.device)
                          for _ in range(spec.num_layers)]
        runner.drafter = self

    # ---- the runner side -------------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, inputs: StepInputs, hidden: torch.Tensor,
                   states: list[CachedRequestState]) -> None:
        """Fill the draft cache over the step's tokens, then draft for the rows that sampled
        (`hidden`, the target's, is not used)."""
        device_inputs = inputs.on_device()
        self.model(device_inputs.input_ids, device_inputs.positions, self.kv_caches,
                   device_inputs.attn_metadata)
        sampling = {id(s) for s in inputs.sampling_states}
        chain = [s for s in states if id(s) in sampling]
        if not chain:
            return
        drafts = [[] for _ in chain]
        probs = [[] for _ in chain]
        positions = [len(s.token_ids) - 1 for s in chain]   # the newest committed token
        tokens = [s.token_ids[-1] for s in chain]
        for j in range(self.gamma):
            step = chain_inputs(chain, [p + j for p in positions], tokens,
                                self.runner.block_size, self.runner.device,
                                self._first_scratch, self._scratch_per_row).on_device()
            out = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
            q = self.model.compute_logits(out).softmax(dim=-1)
            top_prob, top_ids = q.max(dim=-1)
            tokens = top_ids.tolist()
            for r, (token, prob) in enumerate(zip(tokens, top_prob.tolist())):
                drafts[r].append(token)
                probs[r].append(prob)
        for state, ids, qs in zip(chain, drafts, probs):
            self._drafts[state.request_id] = (len(state.token_ids), ids, qs)
