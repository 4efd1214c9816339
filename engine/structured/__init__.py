"""Structured outputs: constrain generation to a JSON schema, regex or EBNF grammar.

- `backend.py` — the small `GrammarBackend` / `GrammarMatcher` protocols and the constraint key.
- `xgrammar_backend.py` — the XGrammar adapter (Dong et al. 2024, "XGrammar: Flexible and
  Efficient Structured Generation Engine for Large Language Models", arXiv 2411.15100).
- `manager.py` — `StructuredOutputManager`: the compile cache (thread-safe, so compilation runs
  off the step loop) and one matcher per request.
- `validity.py` — `check_valid` (a JSON schema is valid and satisfiable, its verdict cached;
  every backend's first check, and the server's for tool parameters).
- `enforceable.py` — what XGrammar enforces exactly.

Light on purpose: importing this package imports neither torch nor xgrammar.
"""

from deepinfer.engine.structured.backend import GrammarError, grammar_key
from deepinfer.engine.structured.validity import check_valid

__all__ = ["GrammarError", "check_valid", "grammar_key"]
