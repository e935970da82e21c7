"""The Python client's types against their one source, the proto: the client imports nothing of the server, so its
typed results are generated from the proto (clients/python/generate.py writes tokenloop_client/_gen/messages.py,
which the package exports beside types.py's own) and its generation options (`GenerationParams`) are checked
here, field for field, against the messages the server fills (service/convert.py and service/app.py map the
server's own types, looper/stream.py's events and core/executor.py's stats, onto the same messages)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import tokenloop_client as client  # the package exports every typed result
from tokenloop.v1 import tokenloop_pb2 as server_pb
from tokenloop_client._gen import tokenloop_pb2 as pb
from tokenloop_client._request import GenerationParams

MIRRORS = [  # client type, the message it is built from
    (client.ChatMessage, pb.ChatMessage), (client.TopLogprob, pb.TopLogprob), (client.TokenLogprob, pb.TokenLogprob),
    (client.Usage, pb.Usage), (client.Timing, pb.Timing), (client.Delta, pb.Chunk), (client.Completion, pb.Complete),
    (client.TokenizeResult, pb.TokenizeResponse), (client.EmbedResult, pb.EmbedResponse),
    (client.ModelInfo, pb.ModelInfo), (client.LoraAdapter, pb.LoraAdapter), (client.Load, pb.Load),
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


@pytest.mark.parametrize("client_type, message", MIRRORS, ids=[c.__name__ for c, _ in MIRRORS])
def test_each_client_type_has_the_fields_of_its_message_with_its_defaults(client_type, message):
    assert [f.name for f in dataclasses.fields(client_type)] == proto_fields(message)
    assert client_type.from_pb(message()) == client_type()  # an unset field reads as the type's default


def test_the_generated_types_are_those_of_the_proto_as_it_is():
    """`generate.py --check` (also run by `make proto-check`) regenerates the stubs and the typed results from the
    .proto and compares them with the committed ones: a field added to the proto fails here until `make proto`."""
    script = Path(__file__).resolve().parents[2] / "clients" / "python" / "generate.py"
    run = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_typed_results_are_built_from_their_messages():
    msg = pb.Complete(index=1, text="ab", token_ids=[3, 4], finish_reason=pb.STOP_SEQUENCE, matched_stop_str="b",
                      usage=pb.Usage(prompt_tokens=5, completion_tokens=2), seed=7)
    done = client.Completion.from_pb(msg)
    assert (done.index, done.text, done.token_ids, done.finish_reason) == (1, "ab", (3, 4), client.FinishReason.STOP_SEQUENCE)
    assert (done.matched_stop, done.usage, done.seed, done.timing) == ("b", client.Usage(5, 2), 7, client.Timing())
    assert client.Completion.from_pb(pb.Complete(matched_stop_token_id=9)).matched_stop == 9
    assert client.Completion.from_pb(pb.Complete()).matched_stop is None
    assert client.ModelInfo.from_pb(pb.ModelInfo()).bos_token_id is None
    assert client.ModelInfo.from_pb(pb.ModelInfo(bos_token_id=0)).bos_token_id == 0
    assert client.EmbedResult.from_pb(pb.EmbedResponse(pooling=pb.MEAN)).pooling == "mean"
    assert client.Load.from_pb(pb.Load(num_running=3, spec_tokens_per_step=1.5)) == client.Load(num_running=3,
                                                                                              spec_tokens_per_step=1.5)


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
    assert [r.value for r in client.FinishReason] == [v.name for v in pb.FinishReason.DESCRIPTOR.values]


def test_the_check_sees_a_missing_field():
    """A type that drops a field of its message fails the comparison (the check reads real fields)."""
    @dataclasses.dataclass(frozen=True)
    class Short:
        prompt_tokens: int = 0
        completion_tokens: int = 0
    assert sorted(f.name for f in dataclasses.fields(Short)) != sorted(proto_fields(pb.Usage))
    assert proto_fields(pb.Complete)[4] == "matched_stop"  # a oneof of two fields is one client field
