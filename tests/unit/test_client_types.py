"""The Python client's types against their one source, the proto: the client imports nothing of the server, so its
dataclasses (clients/python/tokenloop_client/types.py) and generation options (`GenerationParams`) are checked here,
field for field, against the messages the server fills (service/convert.py and service/app.py map the server's own
types, looper/stream.py's events and core/executor.py's stats, onto the same messages)."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf.descriptor import FieldDescriptor

from tokenloop.v1 import tokenloop_pb2 as server_pb
from tokenloop_client import types
from tokenloop_client._gen import tokenloop_pb2 as pb
from tokenloop_client._request import GenerationParams

MIRRORS = [  # client type, the message it is built from
    (types.ChatMessage, pb.ChatMessage), (types.TopLogprob, pb.TopLogprob), (types.TokenLogprob, pb.TokenLogprob),
    (types.Usage, pb.Usage), (types.Timing, pb.Timing), (types.Delta, pb.Chunk), (types.Completion, pb.Complete),
    (types.TokenizeResult, pb.TokenizeResponse), (types.EmbedResult, pb.EmbedResponse),
    (types.ModelInfo, pb.ModelInfo), (types.LoraAdapter, pb.LoraAdapter), (types.Load, pb.Load),
]


def proto_fields(message) -> list[str]:
    """The message's fields in order, a oneof of several fields as one field named after it (proto3's `optional`
    is a oneof of one: its field's own name)."""
    out = []
    for f in message.DESCRIPTOR.fields:
        oneof = f.containing_oneof
        name = oneof.name if oneof is not None and len(oneof.fields) > 1 else f.name
        if name not in out:
            out.append(name)
    return out


def proto_default(field: FieldDescriptor):
    if field.is_repeated:
        return ()
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[0].number
    return field.default_value


@pytest.mark.parametrize("client_type, message", MIRRORS, ids=[c.__name__ for c, _ in MIRRORS])
def test_each_client_type_has_the_fields_of_its_message_with_its_defaults(client_type, message):
    fields = dataclasses.fields(client_type)
    assert sorted(f.name for f in fields) == sorted(proto_fields(message))
    by_name = message.DESCRIPTOR.fields_by_name
    for f in fields:
        if f.default is not dataclasses.MISSING and f.name in by_name:
            assert f.default == proto_default(by_name[f.name]), f.name


def test_the_clients_copy_of_the_proto_is_the_servers():
    """The client's generated code (`_gen`, `make proto`) is built from the same .proto as the server's."""
    assert pb.DESCRIPTOR.serialized_pb == server_pb.DESCRIPTOR.serialized_pb


def test_generation_params_are_the_proto_options_in_order():
    request = pb.GenerateRequest.DESCRIPTOR
    groups = [f.name for g in ("sampling", "stopping", "output") for f in request.fields_by_name[g].message_type.fields]
    top = ["n", *(f.name for f in request.oneofs_by_name["structured"].fields), "lora"]
    assert [f.name for f in dataclasses.fields(GenerationParams)] == groups + top
    assert all(f.default is None for f in dataclasses.fields(GenerationParams))  # None: the server's default


def test_finish_reasons_are_the_protos():
    assert [r.value for r in types.FinishReason] == [v.name for v in pb.FinishReason.DESCRIPTOR.values]


def test_the_check_sees_a_missing_field():
    """A type that drops a field of its message fails the comparison (the check reads real fields)."""
    @dataclasses.dataclass(frozen=True)
    class Short:
        prompt_tokens: int = 0
        completion_tokens: int = 0
    assert sorted(f.name for f in dataclasses.fields(Short)) != sorted(proto_fields(pb.Usage))
    assert proto_fields(pb.Complete)[4] == "matched_stop"  # a oneof of two fields is one client field
