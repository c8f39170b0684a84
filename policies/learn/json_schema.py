"""Whether a JSON value follows a JSON Schema: the keywords structured outputs use, with a bounded cost.

Checked: type, enum, const, properties, required, additionalProperties, items, prefixItems,
min/maxItems, min/maxLength, min/maxProperties, minimum, maximum, exclusiveMinimum/Maximum,
anyOf, oneOf, allOf, not, and `$ref` into the same document (`#`, `#/$defs/...`, `#/definitions/...`).
Not checked (accepted): pattern and format, whose regular expressions would run on the event
loop with the client's pattern, and every other keyword. A schema that needs more than
MAX_STEPS checks, or `$ref`s deeper than MAX_DEPTH, is a failure: the answer is not kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_STEPS = 50_000
MAX_DEPTH = 64


class _TooCostly(Exception):
    pass


def conforms(value: Any, schema: Any) -> bool:
    """Whether `value` (parsed JSON) follows `schema`; False where the check would cost too much."""
    try:
        return _Check(schema).run(value, schema, 0)
    except (_TooCostly, RecursionError):
        return False


_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}


class _Check:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.steps = 0

    def run(self, value: Any, schema: Any, depth: int) -> bool:
        self.steps += 1
        if self.steps > MAX_STEPS or depth > MAX_DEPTH:
            raise _TooCostly
        if schema is False:
            return False
        if not isinstance(schema, Mapping):
            return True  # `true`, or no schema at all
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref)
            if target is None or not self.run(value, target, depth + 1):
                return False
        return self._type(value, schema) and self._values(value, schema) and self._combined(value, schema, depth) and (
            self._object(value, schema, depth) if isinstance(value, dict) else
            self._array(value, schema, depth) if isinstance(value, list) else
            self._scalar(value, schema)
        )  # fmt: skip

    def _resolve(self, ref: str) -> Any:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None  # a remote document is never fetched
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    @staticmethod
    def _type(value: Any, schema: Mapping[str, Any]) -> bool:
        want = schema.get("type")
        if want is None:
            return True
        names = want if isinstance(want, list) else [want]
        return any(name in _TYPES and _TYPES[name](value) for name in names)

    @staticmethod
    def _values(value: Any, schema: Mapping[str, Any]) -> bool:
        if "const" in schema and not _equal(value, schema["const"]):
            return False
        enum = schema.get("enum")
        return not isinstance(enum, list) or any(_equal(value, option) for option in enum)

    def _combined(self, value: Any, schema: Mapping[str, Any], depth: int) -> bool:
        all_of, any_of, one_of = schema.get("allOf"), schema.get("anyOf"), schema.get("oneOf")
        if isinstance(all_of, list) and not all(self.run(value, s, depth + 1) for s in all_of):
            return False
        if isinstance(any_of, list) and not any(self.run(value, s, depth + 1) for s in any_of):
            return False
        if isinstance(one_of, list) and sum(1 for s in one_of if self.run(value, s, depth + 1)) != 1:
            return False
        return "not" not in schema or not self.run(value, schema["not"], depth + 1)

    def _object(self, value: dict[str, Any], schema: Mapping[str, Any], depth: int) -> bool:
        required = schema.get("required")
        if isinstance(required, list) and any(name not in value for name in required if isinstance(name, str)):
            return False
        if not _within(len(value), schema, "minProperties", "maxProperties"):
            return False
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                if not self.run(item, properties[name], depth + 1):
                    return False
            elif extra is False or (isinstance(extra, Mapping) and not self.run(item, extra, depth + 1)):
                return False
        return True

    def _array(self, value: list[Any], schema: Mapping[str, Any], depth: int) -> bool:
        if not _within(len(value), schema, "minItems", "maxItems"):
            return False
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # the older spelling of prefixItems
            prefix, items = items, schema.get("additionalItems", True)
        head = prefix if isinstance(prefix, list) else []
        for index, item in enumerate(value):
            sub = head[index] if index < len(head) else items
            if sub is not None and not self.run(item, sub, depth + 1):
                return False
        return True

    @staticmethod
    def _scalar(value: Any, schema: Mapping[str, Any]) -> bool:
        if isinstance(value, str):
            return _within(len(value), schema, "minLength", "maxLength")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
        above, below = _bound(schema, "exclusiveMinimum"), _bound(schema, "exclusiveMaximum")
        return ((low is None or value >= low) and (high is None or value <= high)
                and (above is None or value > above) and (below is None or value < below))  # fmt: skip


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bound(schema: Mapping[str, Any], key: str) -> float | None:
    value = schema.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _within(size: int, schema: Mapping[str, Any], low: str, high: str) -> bool:
    lo, hi = _bound(schema, low), _bound(schema, high)
    return (lo is None or size >= lo) and (hi is None or size <= hi)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(type(a) is type(b) or (_number(a) and _number(b))) and a == b
