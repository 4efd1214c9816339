"""Speculative decoding, DSpark style (issue 30; /work/shared/notes/dspark.md).

- drafter.py: the drafter interface (drafts + per-position conditional confidences).
- ngram.py: prompt/context lookup drafter with counter-calibrated confidences (pure Python).
- admission.py: which drafts to verify (DSpark's confidence-scheduled varlen, or fixed).
- step_rate.py: the steps/s-vs-batch-tokens table the varlen admission reads.
- manager.py: `SpecDecoder`, the step loop's glue (propose before schedule, observe after).
- rejection.py: speculative (rejection) sampling for drafters with a draft distribution (torch).
- mtp.py: the DeepSeek MTP drafter (torch), runs in the model runner after each step.
- draft_model.py: a small same-tokenizer model as drafter (torch), likewise.
- profile.py: the start-up profile of the verify path for step_rate.py (torch).

Acceptance lives in the model runner (engine/model_runner.py `_commit_drafts`).
"""
