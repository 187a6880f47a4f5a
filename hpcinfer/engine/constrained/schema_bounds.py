"""A JSON schema made fit to hold an answer that ends: numbers with bounded digits, and the parts
no finite value fits pruned; a schema no finite value fits is refused.

    versions(schema) -> the schemas to compile, most bounded first (ValueError: no finite JSON
                        value fits `schema`; the message says why)

Every version admits a subset of the schema's finite values, so an answer that matches it is
valid against the schema as written:
1. Numbers. llguidance's number is `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`: a model can
   write digits for ever (`328.12598888...` until max_tokens). A `number` or `integer` the schema
   does not bound on a side gets |x| < 10^INTEGER_DIGITS there, and a `number` without
   `multipleOf` gets at most FRACTION_DIGITS digits after the point (`multipleOf: 1e-6`; more if
   the schema's own bounds are written with more). llguidance then writes them without exponents.
2. Any value. `{}`, `true`, an object's unlisted properties (`additionalProperties` not given) and
   an array's items (`items` not given) admit any JSON value, numbers inside it too: they become a
   reference to a bounded "any value" definition added to `$defs`.
3. Parts no finite value fits (a `$ref` that only refers to itself or nests without end, `false`,
   `not: {}`, an `allOf` with such a part) become `false`; llguidance would otherwise let an
   answer into them (an optional property whose value can never end) and leave it at a dead end.
   A schema that is itself such a part is refused.

NOTE: the analysis is sound, not complete: it calls a part empty only where no finite value fits
it (a least fixpoint over `$ref`s); what it cannot judge (patterns, formats, intersections) it
leaves to llguidance, which refuses what it can prove empty and otherwise ends a dead end's
answer as cut ("length"). `not`, `if` and `propertyNames` are left as written: bounding inside
them would widen the schema, not narrow it. The versions after the first drop the any-value
definition, then the number bounds: for a schema whose intersections llguidance cannot compile
once they are added.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any
from urllib.parse import unquote

INTEGER_DIGITS = 15  # |x| < 10^15: the integers a float64 holds exactly, give or take
FRACTION_DIGITS = 6
ANY_NAME = "hpcinfer_any_value"
_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
# Keys that do not constrain a value: a schema of only these admits any value.
_NOT_CONSTRAINTS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
        "$schema", "$id", "$anchor", "$defs", "definitions", "x-guidance",
    }
)  # fmt: skip
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "then", "else")
_MANY = ("prefixItems", "allOf", "anyOf", "oneOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def versions(schema: Any) -> list[Any]:
    """The schemas to try, most bounded first; ValueError when no finite JSON value fits `schema`."""
    try:
        return _versions(schema)
    except RecursionError:
        raise ValueError("the schema nests too deeply") from None


def _versions(schema: Any) -> list[Any]:
    finite = _Finite(schema)
    if not finite.holds(schema):
        if schema is False:
            raise ValueError("the schema is false: no value fits it")
        empty = sorted(ref for ref, holds in finite.refs.items() if not holds)
        detail = f" (a value of {', '.join(empty)} would nest without end)" if empty else ""
        raise ValueError(f"no finite JSON value fits the schema{detail}")
    name = ANY_NAME
    defs = schema.get("$defs") if isinstance(schema, dict) else None
    while isinstance(defs, dict) and name in defs:
        name += "_"
    out = []
    for bound, any_ref in ((True, f"#/$defs/{name}"), (True, None), (False, None)):
        rewrite = _Rewrite(finite, bound, any_ref)
        root = rewrite.schema(schema)
        if root is True:
            root = {}
        if rewrite.used_any:
            defs = root.get("$defs") if isinstance(root.get("$defs"), dict) else {}
            root = {**root, "$defs": {**defs, name: _any_value(any_ref or "")}}
        out.append(root)
    return out


def _any_value(ref: str) -> dict[str, Any]:
    """Any JSON value, its numbers bounded as an unbounded `number` is."""
    item = {"$ref": ref}
    number = _bounded({"type": "number"})
    kinds = [{"type": "null"}, {"type": "boolean"}, number, {"type": "string"},
             {"type": "array", "items": item}, {"type": "object", "additionalProperties": item}]  # fmt: skip
    return {"anyOf": kinds}


def _is_any(s: Any) -> bool:
    return s is True or (isinstance(s, dict) and all(k in _NOT_CONSTRAINTS for k in s))


def _types(s: dict[str, Any]) -> set[str]:
    t = s.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set(_TYPES)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _bounded(s: dict[str, Any]) -> dict[str, Any]:
    """`s` with its numbers' digits bounded where `s` leaves them unbounded (see the module's 1.)."""
    types = _types(s)
    if not types & {"number", "integer"}:
        return s
    out = dict(s)
    lows = [v for v in (s.get("minimum"), s.get("exclusiveMinimum")) if _is_number(v)]
    highs = [v for v in (s.get("maximum"), s.get("exclusiveMaximum")) if _is_number(v)]
    # NOTE: a cap past the schema's own bound on the other side, so the two never leave nothing
    widest = max((abs(v) for v in lows + highs), default=0)
    cap = 10 ** max(INTEGER_DIGITS, len(str(int(widest))) + 1)
    if not lows:
        out["exclusiveMinimum" if "exclusiveMinimum" not in s else "minimum"] = -cap
    if not highs:
        out["exclusiveMaximum" if "exclusiveMaximum" not in s else "maximum"] = cap
    if "number" in types and "multipleOf" not in s:
        places = max([FRACTION_DIGITS, *(_decimals(v) for v in lows + highs)])
        if places <= 300:  # NOTE: 10**-places stays a float above zero
            out["multipleOf"] = 10.0**-places
    return out


def _decimals(v: float) -> int:
    """Digits after the point of `v` as written (1e-07: 7)."""
    exponent = Decimal(repr(v)).as_tuple().exponent
    return -exponent if isinstance(exponent, int) and exponent < 0 else 0


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` (`#`, `#/json/pointer`) names; None for any other."""
    if not ref.startswith("#") or (ref != "#" and not ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(node: Any) -> set[str]:
    """Every `$ref` string in the document."""
    found: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if isinstance(n.get("$ref"), str):
                found.add(n["$ref"])
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return found


class _Finite:
    """Which parts of a schema some finite JSON value fits: `refs` per local `$ref` (the least
    fixpoint: a reference holds a value once its target does without it), `holds` per part."""

    def __init__(self, root: Any) -> None:
        self.root = root
        targets = {ref: _resolve(root, ref) for ref in _refs(root)}
        self.targets = {ref: t for ref, t in targets.items() if t is not None}
        self.refs = dict.fromkeys(self.targets, False)
        self._memo: dict[int, bool] = {}
        changed = True
        while changed:  # NOTE: monotone (refs only turn True), so at most len(refs) + 1 rounds
            changed = False
            self._memo = {}
            for ref, target in self.targets.items():
                if not self.refs[ref] and self.holds(target):
                    self.refs[ref] = changed = True
        self._memo = {}

    def holds(self, s: Any) -> bool:
        """Whether some finite JSON value fits `s` (False only where none can)."""
        if isinstance(s, bool):
            return s
        if not isinstance(s, dict):
            return True  # malformed: llguidance says what is wrong with it
        key = id(s)
        if key not in self._memo:
            self._memo[key] = self._holds(s)
        return self._memo[key]

    def _holds(self, s: dict[str, Any]) -> bool:
        ref = s.get("$ref")
        if isinstance(ref, str) and not self.refs.get(ref, True):
            return False
        if "not" in s and _is_any(s["not"]):
            return False
        branches = s.get("allOf")
        if isinstance(branches, list) and not all(self.holds(b) for b in branches):
            return False
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list) and not any(self.holds(b) for b in branches):
                return False
        if "const" in s or "enum" in s:
            return True  # literal values: finite
        return any(self._holds_as(t, s) for t in _types(s))

    def _holds_as(self, kind: str, s: dict[str, Any]) -> bool:
        if kind == "array":
            least = s.get("minItems", 0) if _is_number(s.get("minItems")) else 0
            items = s.get("items")
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            rest = items
            if isinstance(items, list):  # the older tuple form
                prefix, rest = items, s.get("additionalItems")
            if not all(self.holds(p) for p in prefix[: int(least)]):
                return False
            if least > len(prefix) and rest is not None and not self.holds(rest):
                return False
            least_contained = s.get("minContains", 1)
            return "contains" not in s or least_contained == 0 or self.holds(s["contains"])
        if kind == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            required = s.get("required") if isinstance(s.get("required"), list) else []
            for name in required:
                if not isinstance(name, str):
                    continue
                if name in props:
                    part = props[name]
                elif s.get("patternProperties"):
                    continue  # a pattern may take it: not judged here
                else:
                    part = s.get("additionalProperties", True)
                if not self.holds(part):
                    return False
        return True  # NOTE: an unknown type too: llguidance names it


class _Rewrite:
    """One version of the schema: empty parts as `false`, and (`bound`) numbers bounded, and (with
    `any_ref`) any-value parts as that reference."""

    def __init__(self, finite: _Finite, bound: bool, any_ref: str | None) -> None:
        self.finite, self.bound, self.any_ref = finite, bound, any_ref
        self.used_any = False

    def schema(self, s: Any) -> Any:
        if not self.finite.holds(s):
            return False
        if not isinstance(s, dict):
            return self._any({}) if s is True and self.any_ref else s
        out = dict(s)
        for key in _ONE:
            if isinstance(s.get(key), dict | bool):
                out[key] = self.schema(s[key])
        for key in (*_MANY, "items"):
            if isinstance(s.get(key), list):
                out[key] = [self.schema(b) for b in s[key]]
        for key in _NAMED:
            if isinstance(s.get(key), dict):
                out[key] = {name: self.schema(b) if isinstance(b, dict | bool) else b for name, b in s[key].items()}
        if _is_any(s):
            return self._any(out)
        if "const" in s or "enum" in s:
            return out  # literal values
        if "type" not in s and any(k in s for k in ("$ref", "allOf", "anyOf", "oneOf")):
            return out  # NOTE: its branches are bounded; adding to it would make llguidance intersect them
        if self.bound:
            out = _bounded(out)
        if self.any_ref:
            types = _types(s)
            if "array" in types and "items" not in s:
                out["items"] = self._any({})
            if "object" in types and "additionalProperties" not in s and "unevaluatedProperties" not in s:
                out["additionalProperties"] = self._any({})
        return out

    def _any(self, s: dict[str, Any]) -> Any:
        if self.any_ref is None:
            return s or True
        self.used_any = True
        return {**s, "$ref": self.any_ref}


__all__ = ["ANY_NAME", "FRACTION_DIGITS", "INTEGER_DIGITS", "versions"]
