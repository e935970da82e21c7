"""service/decoding.py: a payload that does not parse becomes a marker naming the request type and what is wrong
(every RPC of every service through a server: tests/integration/test_undecodable.py)."""

from __future__ import annotations

import pytest

from tokenloop.service.decoding import Undecodable, decoder
from tokenloop.v1 import tokenloop_pb2 as pb


@pytest.mark.parametrize("payload, detail", [
    (b"\x0a\x05abc", "Wire format was corrupt"), (b"\xff" * 8, "Wire format was corrupt"),
    (b"\x0a\x02\xff\xfe", "String field had bad UTF-8")])
def test_an_undecodable_payload_becomes_a_marker_naming_the_type(payload, detail):
    decode = decoder(pb.GenerateRequest.FromString)
    assert decode(pb.GenerateRequest(text="ok").SerializeToString()).text == "ok"
    marker = decode(payload)
    assert type(marker) is Undecodable
    assert marker.message == f"the request is not a valid tokenloop.v1.GenerateRequest: {detail}"
