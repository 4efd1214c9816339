"""Speculative (rejection) sampling of one verify row (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

For drafts x_1..x_k drawn from the draft distributions q_1..q_k, with the target distributions
p_1..p_{k+1} (after temperature / top-k / top-p / min-p, i.e. exactly what plain sampling draws
from; p_{j} conditioned on x_{<j}): accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), left
to right; at the first rejection emit a token from the residual norm(max(0, p_j - q_j)) and stop;
when all k pass, emit a bonus token from p_{k+1}. Every committed token is then distributed as
plain sampling from the target would draw it, whatever q is. A point-mass draft (n-gram,
q = one-hot) reduces to: accept with probability p_j(x_j), else draw from p_j without x_j.

deepinfer's runner verifies every request by the keyed exponential race instead (accept x_j iff
it equals the target's own seeded sample, engine/model_runner.py), which is exact for any
drafter and gives the same acceptance probability p_j(x_j) for point-mass drafts; this
function is the higher-acceptance rule for drafters with a draft distribution (mtp,
draft_model) on requests without a seed.
"""

from __future__ import annotations

import torch

RESIDUAL_EPS = 1e-12   # residual mass below this: draw from p_j itself (p_j == q_j up to rounding)


def rejection_sample(target_probs: torch.Tensor, draft_ids: list[int],
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The committed tokens of one verify row.

    Args:
        target_probs: [k + 1, V] float32, row j the target distribution at draft position j
            (row k: the bonus position), each row summing to 1.
        draft_ids: the k drafts.
        draft_probs: [k, V] float32, the distributions the drafts were drawn from; None for
            point-mass drafts (n-gram).
        generator: the random source (None: torch's default).
    Returns:
        1 to k + 1 token ids: the accepted drafts, then the residual or bonus token.
    """
    k = len(draft_ids)
    device = target_probs.device
    uniforms = torch.rand(k, generator=generator, device=device) if k else None
    committed: list[int] = []
    for j, token in enumerate(draft_ids):
        p = target_probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        ratio = float(p[token]) / q_token if q_token > 0 else float("inf")
        if float(uniforms[j]) < min(1.0, ratio):
            committed.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= RESIDUAL_EPS:
            residual = p
        committed.append(int(torch.multinomial(residual, 1, generator=generator)))
        return committed
    committed.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return committed
