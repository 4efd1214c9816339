"""Which JSON schemas XGrammar enforces exactly: `check_enforceable` refuses the rest.

XGrammar (engine/structured/xgrammar_backend.py) compiles a JSON schema into a grammar, but
some keywords it accepts and then ignores, or drops in combination with others; generating
under such a schema can produce output that does not validate. This module refuses those
schemas with a `GrammarError` (a 400 at the server) that names the keyword, where it is and
what to send instead. Most entries were found by black-box testing against the real server
(outputs checked with `jsonschema`).

`check_valid` (validity.py) comes first, for every backend: a schema its metaschema rejects, or
whose `const` / `enum` values contradict the rest of it, is refused the same way whichever
backend compiles it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.engine.structured.backend import GrammarError

# keywords XGrammar accepts but does not enforce: generating under them could violate the schema
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                     "dependencies", "multipleOf", "contains", "minContains", "maxContains")
# value constraints XGrammar drops next to `enum` / `const`, and string lengths it drops next to
# `pattern` / `format` (black-box testing found outputs violating each)
_VALUE_KEYWORDS = ("pattern", "format", "minLength", "maxLength", "minimum", "maximum",
                   "exclusiveMinimum", "exclusiveMaximum")
LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")   # (?= (?! (?<= (?<!, not escaped
# what in a pattern stands for a character JSON writes escaped (quote, backslash, a control
# character): XGrammar matches the pattern against the escaped JSON text, so the decoded value
# breaks it (found by black-box testing: "^[A-Z]:\\\\[a-z]+$" gave "P:\n")
_JSON_ESCAPED = re.compile(r'["\x00-\x1f]|\\(?:[\\"nrtfv0]|c[A-Za-z]|x(?:[01][0-9A-Fa-f]|22|5[Cc])'
                           r'|u(?:00[01][0-9A-Fa-f]|0022|005[Cc]))')
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames", "not", "if",
                  "then", "else", "unevaluatedProperties", "unevaluatedItems",
                  "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _resolve(schema: Any, root: Any) -> Any:
    """A local `$ref` ("#/$defs/a", any JSON pointer into the document) followed; anything else
    as it is (an unresolvable reference is XGrammar's to report)."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        node = root
        for part in schema["$ref"].lstrip("#").split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return schema
            node = node[part]
        schema, seen = node, seen + 1
    return schema


_ANNOTATIONS = {"$ref", "$defs", "definitions", "title", "description", "$comment", "$id",
                "$schema"}


def _ref_target(ref: str, root: Any) -> Any:
    """One hop of a local `$ref` ("#/$defs/a"), or None where it does not resolve."""
    node = root
    for part in ref.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_ref_cycles(schema: Any, root: Any = None, path: str = "#") -> None:
    """Refuse a chain of nothing but `$ref`s that leads back to itself
    (`{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`): it describes no value;
    XGrammar refuses it, and LLGuidance compiled it to an empty output that "stopped"."""
    root = schema if root is None else root
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_ref_cycles(item, root, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    node, seen = schema, []
    while (isinstance(node, dict) and isinstance(node.get("$ref"), str)
           and not set(node) - _ANNOTATIONS):
        if any(node is earlier for earlier in seen):
            raise GrammarError(f"the $ref at {path} leads only back to itself, so the schema "
                               "describes no value; give the definition a type or properties")
        seen.append(node)
        node = _ref_target(node["$ref"], root)
    for key, value in schema.items():
        if key not in ("enum", "const", "default", "examples") and isinstance(value,
                                                                              (dict, list)):
            check_ref_cycles(value, root, f"{path}/{key}")


def _type_group(branch: dict) -> str | None:
    """The JSON type a branch's `type` allows, integer and number as one; None for several."""
    kind = branch.get("type")
    if isinstance(kind, str):
        return "number" if kind == "integer" else kind
    return None


def _constant_values(branch: dict) -> list | None:
    if "const" in branch:
        return [branch["const"]]
    return branch["enum"] if isinstance(branch.get("enum"), list) else None


def _discriminator(branch: dict, name: str) -> list | None:
    """The values a required property `name` may take in an object branch, if constant."""
    properties = branch.get("properties")
    if (not isinstance(properties, dict) or not isinstance(properties.get(name), dict)
            or name not in (branch.get("required") or [])):
        return None
    return _constant_values(properties[name])


def _disjoint(value_lists: list[list | None]) -> bool:
    if any(values is None for values in value_lists):
        return False
    keys = [json.dumps(value, sort_keys=True) for values in value_lists for value in values]
    return len(keys) == len(set(keys))


def _exclusive(branches: list, root: Any) -> bool:
    """Whether no value can match two of `oneOf`'s branches, by one of three simple proofs:
    distinct JSON types; constant values (`const` / `enum`) that no two branches share; or a
    required property with such constant values in every (object) branch (a discriminated
    union). XGrammar generates `oneOf` as `anyOf`, which is exact only then."""
    branches = [_resolve(branch, root) for branch in branches]
    if not all(isinstance(branch, dict) for branch in branches):
        return False
    groups = [_type_group(branch) for branch in branches]
    if None not in groups and len(set(groups)) == len(groups):
        return True
    if _disjoint([_constant_values(branch) for branch in branches]):
        return True
    first = branches[0].get("properties")
    names = list(first) if isinstance(first, dict) else []
    return any(_disjoint([_discriminator(branch, name) for branch in branches])
               for name in names)


def _names(keywords: list[str]) -> str:
    """Schema keywords as the messages name them: 'pattern', 'format'."""
    return ", ".join(f"'{keyword}'" for keyword in keywords)


def _check_values(schema: dict, path: str) -> None:
    """Refuse value keywords XGrammar drops in combination (see _VALUE_KEYWORDS), and regex
    lookarounds in `pattern` (XGrammar accepts and ignores them)."""
    if "enum" in schema or "const" in schema:
        dropped = [key for key in _VALUE_KEYWORDS if key in schema]
        if dropped:
            raise GrammarError(f"{_names(dropped)} next to 'enum' / 'const' at {path} cannot "
                               "be enforced; keep only the allowed values that satisfy them "
                               "and drop those keywords")
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    shaped = [key for key in ("pattern", "format") if key in schema]
    if lengths and shaped:
        raise GrammarError(f"{_names(lengths)} together with {_names(shaped)} at {path} "
                           "cannot be enforced (the length is dropped); write the length into "
                           "the pattern, e.g. '^[a-z]{1,3}$'")
    pattern = schema.get("pattern")
    patterns = [("pattern", pattern)] + [
        (f"patternProperties key {json.dumps(key)}", key)
        for key in schema.get("patternProperties") or {}
        if isinstance(schema.get("patternProperties"), dict)]
    for where, text in patterns:
        if isinstance(text, str) and _JSON_ESCAPED.search(_without_escaped_pairs(text)):
            raise GrammarError(f"the {where} at {path} matches a quote, backslash or control "
                               "character, which XGrammar would match against the escaped "
                               "JSON text instead of the string's value; use the 'guidance' "
                               "or 'auto' structured-outputs backend")
    if isinstance(pattern, str) and LOOKAROUND.search(pattern):
        raise GrammarError(f"the pattern at {path} uses a lookahead or lookbehind, which "
                           "cannot be enforced while generating; rewrite it without one")
    _check_numeric_bounds(schema, path)


# XGrammar writes a number range's bounds with 6 decimals and through float64: a bound finer
# than that, or past 2**53, gives a range grammar that admits nothing or the wrong values (its
# grammar for [1e-17, 2e-17] is the empty string: `{"v": }` came back as "stop")
_RANGE_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _check_numeric_bounds(schema: dict, path: str) -> None:
    for key in _RANGE_KEYS:
        bound = schema.get(key)
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            continue
        if abs(bound) >= 2 ** 53 or round(float(bound), 6) != bound:
            raise GrammarError(f"'{key}': {bound} at {path} needs more precision than "
                               "XGrammar's range grammar keeps (6 decimals, |x| < 2**53); use "
                               "the 'guidance' or 'auto' structured-outputs backend")


def _without_escaped_pairs(pattern: str) -> str:
    """`pattern` with each escape pair other than a quote / backslash / control escape removed
    (read left to right, so `\\\\d` is an escaped backslash, then `d`)."""
    kept, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] in '\\"nrtfv0cxu':
                kept.append(pattern[i:i + 2])
            i += 2
        else:
            kept.append(pattern[i])
            i += 1
    return "".join(kept)


def _check_object(schema: dict, path: str) -> None:
    """Refuse `minProperties` / `maxProperties` on an object whose keys are not all named in
    `properties`: generated keys may repeat (`{"a": 1, "a": 2}`), so the count cannot be
    enforced."""
    counts = [key for key in ("minProperties", "maxProperties") if key in schema]
    open_keys = [key for key in ("patternProperties", "propertyNames") if key in schema]
    if schema.get("additionalProperties") not in (None, False):
        open_keys.append("additionalProperties")
    if counts and open_keys:
        raise GrammarError(f"{_names(counts)} with {_names(open_keys)} at {path} cannot be "
                           "enforced (generated keys may repeat); name the properties in "
                           "'properties' instead")
    minimum = schema.get("minProperties")
    properties, required = schema.get("properties") or {}, schema.get("required") or []
    if isinstance(properties, dict) and isinstance(required, list):
        named = set(properties) | {name for name in required if isinstance(name, str)}
        if isinstance(minimum, int) and not open_keys and minimum > len(named):
            raise GrammarError(f"'minProperties': {minimum} at {path}, but the object names "
                               f"{len(named)} properties and no others are generated; "
                               "declare them in 'properties'")


def subschemas(schema: Any, path: str):
    """(JSON pointer, subschema) for `schema` and every schema object nested in it."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SCHEMA_VALUES:
        yield from subschemas(schema.get(key), f"{path}/{key}")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from subschemas(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from subschemas(sub, f"{path}/{key}/{i}")


def check_enforceable(schema: Any, path: str = "#", in_branch: bool = False,
                       root: Any = None) -> None:
    """Refuse (GrammarError) what XGrammar would silently ignore, so that no output can violate
    the schema: `not`, `if`/`then`/`else`, `dependent*`, `multipleOf`, `contains`,
    `uniqueItems: true`, `allOf` with more than one subschema, a `oneOf` whose branches are not
    provably exclusive, `$ref` outside the document, the value combinations of `_check_values`
    and `_check_object`, and a `required` property that `additionalProperties: false` forbids
    (no output can satisfy it; not checked inside an `anyOf` / `oneOf` branch, where another
    branch may still be satisfiable)."""
    if not isinstance(schema, dict):
        return
    root = schema if root is None else root
    for keyword in _IGNORED_KEYWORDS:
        if keyword in schema:
            raise GrammarError(f"JSON schema keyword {keyword!r} at {path} is not supported "
                               "(it cannot be enforced while generating); remove it")
    if schema.get("uniqueItems") is True:
        raise GrammarError(f"JSON schema keyword 'uniqueItems' at {path} is not supported (it "
                           "cannot be enforced while generating); remove it")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise GrammarError(f"'allOf' with {len(all_of)} subschemas at {path} is not supported; "
                           "merge them into one schema")
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _exclusive(one_of, root):
        raise GrammarError(f"'oneOf' at {path} is generated as 'anyOf', and a value could "
                           "match several of its branches; use 'anyOf', or make the branches "
                           "exclusive (distinct types, distinct 'const' / 'enum' values, or a "
                           "required property with a distinct 'const' in each)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise GrammarError(f"'$ref': {json.dumps(ref)} at {path} points outside the schema; "
                           "only local references ('#/$defs/...') are supported, so inline it")
    _check_values(schema, path)
    _check_object(schema, path)
    required, properties = schema.get("required"), schema.get("properties") or {}
    if (not in_branch and schema.get("additionalProperties") is False
            and isinstance(required, list) and "patternProperties" not in schema
            and isinstance(properties, dict)):
        forbidden = [name for name in required if name not in properties]
        if forbidden:
            raise GrammarError(f"the object at {path} requires {forbidden} but "
                               "'additionalProperties': false forbids them (no output can "
                               "satisfy it); add them to 'properties'")
    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), dict):
            check_enforceable(schema[key], f"{path}/{key}", in_branch, root)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_enforceable(sub, f"{path}/{key}/{name}", in_branch, root)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_enforceable(sub, f"{path}/{key}/{i}",
                                   in_branch or key in ("anyOf", "oneOf"), root)


def exclusive_one_of(schema: Any, root: Any = None) -> Any:
    """The schema with each `oneOf` that can be generated exactly as `anyOf` rewritten so:
    branches `_exclusive` proves exclusive become `anyOf` as they are; branches that differ only
    in `required` (`{"properties": P, "oneOf": [{"required": R_i}, ...]}`, a common "one of
    these sets of fields" idiom) become `anyOf` of closed objects, branch i without the fields
    that only other branches require, so no value matches two. Other `oneOf`s are kept (and
    refused: XGrammar by `check_enforceable`, LLGuidance by itself)."""
    root = schema if root is None else root
    if isinstance(schema, list):
        return [exclusive_one_of(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: value if key in ("enum", "const", "default", "examples")
              else exclusive_one_of(value, root) for key, value in schema.items()}
    _settle_dependencies(schema)
    branches = schema.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return _required_into_branches(schema)
    if _exclusive(branches, root) and "anyOf" not in schema:
        schema["anyOf"] = schema.pop("oneOf")
        return _required_into_branches(schema)
    narrowed = _narrowed_branches(schema, branches)
    if narrowed is not None:
        for key in ("oneOf", "properties", "required", "additionalProperties"):
            schema.pop(key, None)
        schema["anyOf"] = narrowed
    return _required_into_branches(schema)


def _required_into_branches(schema: dict) -> dict:
    """`{"required": R, "anyOf": [B_i]}` with R also in each B_i (the same set of values):
    XGrammar drops a parent's `required` inside `anyOf` branches (found by the benchmark:
    JSONSchemaBench Github_trivial/o35155 gave an object without its required "type")."""
    branches, required = schema.get("anyOf"), schema.get("required")
    if (isinstance(branches, list) and isinstance(required, list) and required
            and all(isinstance(b, dict) and "$ref" not in b for b in branches)):
        schema["anyOf"] = [{**branch, "required": list(dict.fromkeys(
            (branch.get("required") or []) + required))} for branch in branches]
    return schema


def _settle_dependencies(schema: dict) -> None:
    """Drop (in place) `dependencies` / `dependentRequired` entries a strict output settles:
    one whose trigger property cannot appear (the object is closed, as strict outputs close
    objects with `properties`, and does not name it), and one whose trigger is required (its
    dependencies join `required`). Others are kept (and refused)."""
    properties = schema.get("properties")
    closed = (isinstance(properties, dict) and "patternProperties" not in schema
              and schema.get("additionalProperties") in (None, False))
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    for keyword in ("dependencies", "dependentRequired"):
        entries = schema.get(keyword)
        if not isinstance(entries, dict):
            continue
        for trigger, needed in list(entries.items()):
            if closed and trigger not in properties:
                del entries[trigger]
            elif trigger in required and isinstance(needed, list):
                required += [name for name in needed if name not in required]
                del entries[trigger]
        if not entries:
            del schema[keyword]
    if required:
        schema["required"] = required


def _narrowed_branches(schema: dict, branches: list) -> list | None:
    """`exclusive_one_of`'s second case: the closed object branches, or None if it does not
    apply (branches with more than `required`, open extra keys, or a branch whose required
    fields include another's, so a value could match both)."""
    properties = schema.get("properties")
    if (not isinstance(properties, dict) or "anyOf" in schema
            or schema.get("additionalProperties") not in (None, False)
            or "patternProperties" in schema):
        return None
    required_sets = []
    for branch in branches:
        if (not isinstance(branch, dict) or set(branch) - {"required", "description", "title"}
                or not isinstance(branch.get("required"), list)):
            return None
        required_sets.append({name for name in branch["required"] if isinstance(name, str)})
    base = [name for name in schema.get("required") or [] if isinstance(name, str)]
    narrowed = []
    for i, own in enumerate(required_sets):
        others = [other - own for j, other in enumerate(required_sets) if j != i]
        if any(not extra for extra in others):
            return None
        excluded = set().union(*others)
        allowed = {name: sub for name, sub in properties.items() if name not in excluded}
        allowed.update({name: {} for name in own if name not in allowed})
        narrowed.append({"type": "object", "properties": allowed,
                         "required": list(dict.fromkeys(base + sorted(own))),
                         "additionalProperties": False})
    return narrowed
