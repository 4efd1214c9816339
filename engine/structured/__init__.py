"""Structured outputs: constrain generation to a JSON schema, regex or EBNF grammar.

- `backend.py` — the small `GrammarBackend` / `GrammarMatcher` protocols and the constraint key.
- `xgrammar_backend.py` — the XGrammar adapter (Dong et al. 2024, "XGrammar: Flexible and
  Efficient Structured Generation Engine for Large Language Models", arXiv 2411.15100).
- `manager.py` — `StructuredOutputManager`: the compile cache (thread-safe, so compilation runs
  off the step loop) and one matcher per request.

Light on purpose: importing this package imports neither torch nor xgrammar.
"""

from deepinfer.engine.structured.backend import GrammarError, grammar_key

__all__ = ["GrammarError", "grammar_key"]
