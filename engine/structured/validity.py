"""`check_valid`: a JSON schema is valid (its meta-schema accepts it) and satisfiable (its
`const` / `enum` values fit the rest of it); every backend's first check of a JSON schema, and
the server's for tool parameters. Verdicts are cached (a first check of a large schema took
0.49 s; a repeated one costs a hash).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from deepinfer.engine.structured.backend import GrammarError
from deepinfer.engine.structured.enforceable import subschemas

# check_valid's verdicts kept (least recently used dropped first): a SHA-256 digest and a
# future of None or a message each, so a few hundred bytes however large the schema
_VERDICTS_KEPT = 1024
_verdicts: OrderedDict[bytes, Future] = OrderedDict()
_verdicts_lock = threading.Lock()


def check_valid(schema: Any) -> None:
    """Refuse (GrammarError) a JSON schema that is invalid or cannot be satisfied: one its
    metaschema rejects (Draft 2020-12 unless `$schema` names another draft; e.g. `"type": []`,
    `"anyOf": []`, `"$defs": 5`), a `$schema` that names no meta-schema `jsonschema` knows
    (`SUPPORTED_METASCHEMAS`), `false`, and a `const` / `enum` value that fails the rest of
    its own schema (`{"type": "string", "const": 5}`: XGrammar generated the 5, and
    `"enum": ["a", null]` next to `"type": "string"` the null). `$ref`s resolve against the
    whole document (`jsonschema`); one that does not resolve is left to the backend. A schema
    nested too deeply to walk (Python's recursion limit) is refused too.

    The verdict is cached by the schema's canonical JSON (keys sorted, which changes no
    verdict), the last `_VERDICTS_KEPT` of them: a schema seen before costs one hash, where a
    first check of a large one took 0.49 s. Thread-safe, and threads asking for one new
    schema at once wait for one check; callers on an event loop run it in a worker thread.
    """
    try:
        canonical = json.dumps(schema, sort_keys=True, ensure_ascii=False,
                               separators=(",", ":"))
    except RecursionError:
        raise GrammarError(_TOO_DEEP) from None
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).digest()
    with _verdicts_lock:
        verdict = _verdicts.get(digest)
        owner = verdict is None
        if owner:
            verdict = _verdicts[digest] = Future()
            while len(_verdicts) > _VERDICTS_KEPT:
                _verdicts.popitem(last=False)
        else:
            _verdicts.move_to_end(digest)
    if owner:
        try:
            verdict.set_result(_problem(schema))
        except BaseException as exc:   # a bug in the check must not hang the other waiters
            verdict.set_exception(exc)
    problem = verdict.result()
    if problem is not None:
        raise GrammarError(problem)


_TOO_DEEP = ("the JSON schema nests too deeply to check (over ~100 levels); flatten it, e.g. "
             "name repeated parts in '$defs' and point to them with '$ref'")


def _problem(schema: Any) -> str | None:
    """Why `schema` is refused (check_valid), or None when it is valid."""
    try:
        _check_valid(schema)
    except GrammarError as exc:
        return str(exc)
    except RecursionError:
        return _TOO_DEEP
    return None


def _validator_class(schema: Any) -> Any:
    """The `jsonschema` validator of the draft `schema`'s `$schema` names (Draft 2020-12 when
    it names none).

    Raises:
        GrammarError: `$schema` names a meta-schema `jsonschema` does not know (its
            `validator_for` falls back to the latest draft with a warning that this "will
            raise an error in the future"; the backends would read the schema as they please).
    """
    import jsonschema

    if not isinstance(schema, dict) or "$schema" not in schema:
        return jsonschema.Draft202012Validator
    named = schema["$schema"]
    found = (jsonschema.validators.validator_for(schema, None) if isinstance(named, str)
             else None)
    if found is not None:
        return found
    raise GrammarError(f"'$schema': {json.dumps(named, ensure_ascii=False)} at # is not the "
                       "URL of a JSON Schema meta-schema this server knows; use one of "
                       f"{', '.join(json.dumps(url) for url in SUPPORTED_METASCHEMAS)} (or "
                       "leave '$schema' out for Draft 2020-12)")


# the meta-schemas `jsonschema` validates against, newest first (`$schema` may end in "#")
SUPPORTED_METASCHEMAS = ("https://json-schema.org/draft/2020-12/schema",
                         "https://json-schema.org/draft/2019-09/schema",
                         "http://json-schema.org/draft-07/schema",
                         "http://json-schema.org/draft-06/schema",
                         "http://json-schema.org/draft-04/schema",
                         "http://json-schema.org/draft-03/schema")


def _json_spelled(error: Any) -> str:
    """A `jsonschema` error's message with the values it quotes written as JSON (`null`,
    `true`, `"a"`, not Python's `None`, `True`, `'a'`): it builds them with `repr` of the
    instance and of the keyword's value, or of their items (`type` lists, an object's keys)."""
    message = error.message
    values = [error.instance, error.validator_value]
    values += [item for value in values if isinstance(value, (list, dict)) for item in value]
    for value in values:
        try:
            spelled = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            continue
        message = message.replace(repr(value), spelled)
    return message


def _check_valid(schema: Any) -> None:
    import jsonschema
    from referencing.exceptions import Unresolvable

    if schema is False:
        raise GrammarError("the JSON schema `false` allows no value; send a schema object")
    validator_class = _validator_class(schema)
    # `check_schema` without its format checks: they read `pattern`s as Python regexes, which
    # refuses ECMA-262 ones such as "\\p{L}" (a pattern is the backends' to check)
    metaschema = validator_class(validator_class.META_SCHEMA)
    invalid = jsonschema.exceptions.best_match(metaschema.iter_errors(schema))
    if invalid is not None:
        reasons = "; ".join(dict.fromkeys(_json_spelled(error) for error in invalid.context))
        where = "#" + "".join(f"/{part}" for part in invalid.absolute_path)
        raise GrammarError(f"not a valid JSON schema: {_json_spelled(invalid)}"
                           f"{f' ({reasons})' if reasons else ''} at {where}; fix the schema "
                           "(checked against the JSON Schema metaschema of Draft 2020-12, or "
                           "of the draft its $schema names)")
    root = validator_class(schema)
    for path, node in subschemas(schema, "#"):
        constants = [("const", node["const"])] if "const" in node else []
        if isinstance(node.get("enum"), list):
            constants += [("enum", value) for value in node["enum"]]
        for keyword, value in constants:
            # the rest keeps the other keyword: a const outside its own enum is refused too
            rest = {key: sub for key, sub in node.items() if key != keyword}
            try:
                error = next(root.descend(value, rest), None)
            except (Unresolvable, re.error):   # the backend names the $ref or pattern
                break
            if error is not None:
                raise GrammarError(f"the {keyword!r} value {json.dumps(value)} at {path} fails "
                                   f"the rest of its schema ({_json_spelled(error)}): no output "
                                   "can take it; drop the value or change the other keywords "
                                   "to allow it")
