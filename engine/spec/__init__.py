"""Speculative decoding, DSpark style (issue 30; /work/shared/notes/dspark.md).

- drafter.py: the drafter interface (drafts + per-position conditional confidences).
- ngram.py: prompt/context lookup drafter with counter-calibrated confidences (pure Python).
- admission.py: which drafts to verify (DSpark's confidence-scheduled varlen, or fixed).
- step_rate.py: step seconds (plain step by batch tokens + verify extra by drafts) the varlen
  admission reads.
- manager.py: `SpecDecoder`, the step loop's glue (propose before schedule, observe after).
- mtp.py: the DeepSeek MTP drafter (torch), runs in the model runner after each step.
- draft_model.py: a small same-tokenizer model as drafter (torch), likewise.
- profile.py: the start-up profile of the verify path for step_rate.py (torch).

Acceptance lives in the model runner (engine/model_runner.py `_commit_drafts`): a draft is
accepted iff it equals the token the target's own sampler picks there (greedy, seeded or not).
For the drafters here, whose drafts are point masses (argmax or lookup), that accepts draft d
with probability p_target(d), the same as Leviathan et al.'s rejection sampling with q = the
point mass, and keeps the target's distribution exactly; a drafter that samples its drafts would
need the residual resample (not built: none does).
"""
