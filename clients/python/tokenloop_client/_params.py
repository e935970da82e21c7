"""Client-side argument checks: a wrong type or an unrepresentable value is a `ParameterError` naming the parameter.

The rules come from the generated message descriptors (each option's proto field type: a uint32 is an integer
from 0 to 4294967295, a float a number, a bool True or False, a repeated field one value or a sequence of them),
so a field added to the proto is checked without a new rule here. Ranges that depend on the server (1 to
`--max-new-tokens`, temperature >= 0, ...) stay the server's: it answers INVALID_ARGUMENT with its own message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from google.protobuf.descriptor import FieldDescriptor

from .errors import ParameterError

_F = FieldDescriptor
_INT_RANGES = {_F.CPPTYPE_INT32: (-2**31, 2**31 - 1), _F.CPPTYPE_UINT32: (0, 2**32 - 1),
               _F.CPPTYPE_INT64: (-2**63, 2**63 - 1), _F.CPPTYPE_UINT64: (0, 2**64 - 1)}
_KIND = {_F.CPPTYPE_FLOAT: "a number", _F.CPPTYPE_DOUBLE: "a number", _F.CPPTYPE_BOOL: "True or False",
         _F.CPPTYPE_STRING: "a string"}


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_scalar(name: str, value, field: FieldDescriptor) -> None:
    """One value of `field`'s type."""
    kind = field.cpp_type
    if kind in _INT_RANGES:
        lo, hi = _INT_RANGES[kind]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ParameterError(name, f"`{name}` must be an integer; got {_describe(value)}")
        if not lo <= value <= hi:
            raise ParameterError(name, f"`{name}` must be between {lo} and {hi}; got {value}")
    elif kind in (_F.CPPTYPE_FLOAT, _F.CPPTYPE_DOUBLE):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ParameterError(name, f"`{name}` must be {_KIND[kind]}; got {_describe(value)}")
    elif kind == _F.CPPTYPE_BOOL:
        if not isinstance(value, bool):
            raise ParameterError(name, f"`{name}` must be {_KIND[kind]}; got {_describe(value)}")
    elif kind == _F.CPPTYPE_STRING and not isinstance(value, str):
        raise ParameterError(name, f"`{name}` must be {_KIND[kind]}; got {_describe(value)}")


def check_field(name: str, value, field: FieldDescriptor) -> None:
    """A value for `field`: one value, or for a repeated field also a sequence of them."""
    if not field.is_repeated:
        check_scalar(name, value, field)
        return
    if isinstance(value, (str, int, float)):
        check_scalar(name, value, field)
        return
    if not isinstance(value, Iterable) or isinstance(value, (bytes, Mapping)):
        raise ParameterError(name, f"`{name}` must be one value or a list of them; got {_describe(value)}")
    for i, item in enumerate(value):
        check_scalar(f"{name}[{i}]", item, field)


def check_options(params: Mapping, fields: Mapping[str, FieldDescriptor]) -> None:
    """Every keyword option is known and of its field's type (None leaves the server's default)."""
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ParameterError(unknown[0], f"unknown option `{unknown[0]}`; the generation options are "
                                         f"{', '.join(sorted(fields))}")
    for name, value in params.items():
        if value is not None:
            check_field(name, value, fields[name])


def check_text(name: str, value) -> None:
    if not isinstance(value, str):
        raise ParameterError(name, f"`{name}` must be a string; got {_describe(value)}")


def check_token_ids(name: str, value) -> None:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ParameterError(name, f"`{name}` must be a list of token ids; got {_describe(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < 2**32:
            raise ParameterError(name, f"`{name}[{i}]` must be a token id (an integer from 0 to {2**32 - 1}); "
                                       f"got {_describe(item)}")


def chat_message(i: int, msg) -> tuple[str, str]:
    """(role, content) of `messages[i]`: a ChatMessage, a {"role", "content"} dict, or a (role, content) pair."""
    name = f"messages[{i}]"
    if isinstance(msg, Mapping):
        missing = [k for k in ("role", "content") if k not in msg]
        if missing:
            raise ParameterError(name, f"`{name}` needs a 'role' and a 'content'; it has no {missing[0]!r}")
        role, content = msg["role"], msg["content"]
    elif hasattr(msg, "role") and hasattr(msg, "content"):
        role, content = msg.role, msg.content
    elif isinstance(msg, (tuple, list)) and len(msg) == 2:
        role, content = msg
    else:
        raise ParameterError(name, f"`{name}` must be a ChatMessage, a {{'role', 'content'}} dict or a "
                                   f"(role, content) pair; got {_describe(msg)}")
    check_text(f"{name}.role", role)
    check_text(f"{name}.content", content)
    return role, content
