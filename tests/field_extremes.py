"""Every scalar field of a protobuf request message, and the extreme values of its wire type.

`field_cases(descriptor)` walks a request message type (into its message fields, oneofs and repeated fields) and
yields one `FieldCase` per (field, extreme value): 0, -1, the type's min and max, 2^31, 2^32-1, NaN, +-inf, empty,
1 MB, control characters, and invalid UTF-8 (spliced into the serialized bytes, which the wire allows). Each case
serializes to the request bytes with that one field set (on top of a `base` message). Shared by the field-range
tests (tests/unit/test_field_ranges.py, tests/integration/test_field_ranges.py, tests/e2e/test_field_ranges.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor as F

MB = 1 << 20
INVALID_UTF8_MARK = "\ue000\ue001"  # replaced by the bytes ff fe in the serialized message
INT32 = (0, -1, -2**31, 2**31 - 1, 1)
INT64 = (0, -1, -2**63, 2**63 - 1, 2**31, 2**32 - 1, 1)
UINT32 = (0, 1, 2**31, 2**32 - 1)
UINT64 = (0, 1, 2**31, 2**32 - 1, 2**64 - 1)
FLOATS = (0.0, -1.0, 1.0, math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 1e-45)
STRINGS = ("", "a" * MB, "x\n\x1b[31m\x00\u2028y", INVALID_UTF8_MARK)
BYTES = (b"", b"\xff" * MB)
VALUES = {
    F.TYPE_INT32: INT32, F.TYPE_SINT32: INT32, F.TYPE_SFIXED32: INT32,
    F.TYPE_INT64: INT64, F.TYPE_SINT64: INT64, F.TYPE_SFIXED64: INT64,
    F.TYPE_UINT32: UINT32, F.TYPE_FIXED32: UINT32, F.TYPE_UINT64: UINT64, F.TYPE_FIXED64: UINT64,
    F.TYPE_FLOAT: FLOATS, F.TYPE_DOUBLE: FLOATS, F.TYPE_BOOL: (True, False),
    F.TYPE_STRING: STRINGS, F.TYPE_BYTES: BYTES,
}
MAX_DEPTH = 4


@dataclass(frozen=True)
class FieldCase:
    """One field (its dotted path) set to one value; `serialize(base)` gives the request's bytes."""

    path: str
    value: object
    repeated: bool = False

    @property
    def leaf(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    def message(self, base):
        msg = type(base)()
        msg.CopyFrom(base)
        *parents, leaf = self.path.split(".")
        target = msg
        for name in parents:
            target = getattr(target, name)
        if self.repeated:
            getattr(target, leaf).extend(self.value)
        else:
            setattr(target, leaf, self.value)
        return msg

    def serialize(self, base) -> bytes:
        data = self.message(base).SerializeToString()
        mark = INVALID_UTF8_MARK.encode()
        return data.replace(mark, b"\xff\xfe" + b"\x00" * (len(mark) - 2)) if mark in data else data

    def __str__(self) -> str:
        shown = repr(self.value)
        return f"{self.path}={shown[:40]}{'...' if len(shown) > 40 else ''}"


def _enum_values(field) -> tuple[int, ...]:
    numbers = [v.number for v in field.enum_type.values]
    return tuple(dict.fromkeys((0, max(numbers), max(numbers) + 1000, -1)))


def _values(field) -> tuple:
    if field.type == F.TYPE_ENUM:
        return _enum_values(field)
    return VALUES[field.type]


def field_cases(descriptor, prefix: str = "", depth: int = 0, skip: tuple[str, ...] = ()) -> Iterator[FieldCase]:
    """Every (scalar field, extreme value) of `descriptor`, message fields walked into (to MAX_DEPTH); a repeated
    scalar field gets one element of each extreme, and 200,000 zeros; `skip`: dotted paths left out."""
    for field in descriptor.fields:
        path = prefix + field.name
        if path in skip:
            continue
        repeated = field.is_repeated
        if field.type == F.TYPE_MESSAGE:
            if not repeated and not field.message_type.GetOptions().map_entry and depth < MAX_DEPTH:
                yield from field_cases(field.message_type, path + ".", depth + 1, skip)
            continue
        values = _values(field)
        if repeated:
            for value in values:
                yield FieldCase(path, (value,), repeated=True)
            if field.type not in (F.TYPE_STRING, F.TYPE_BYTES):
                yield FieldCase(path, (values[0],) * 200_000, repeated=True)
        else:
            for value in values:
                yield FieldCase(path, value)


def names_field(case: FieldCase, details: str) -> bool:
    """An INVALID_ARGUMENT message names the field: its name, or the message field holding it (`mm_inputs` for
    `mm_inputs.modality`: a refused message is refused whole), or the payload is refused as undecodable (invalid
    UTF-8)."""
    parts = case.path.split(".")
    ancestors = (".".join(parts[:i]) for i in range(1, len(parts)))
    return (case.leaf in details or any(f"`{a}" in details for a in ancestors)
            or "is not a valid" in details)
