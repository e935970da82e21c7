"""Management RPCs, hostile LoRA paths and a long request id against a real `tokenloop serve` (default model) with
`--api-key-file`, `--admin-key-file` and `--lora-root`: LoadLoraAdapter with an API key is PERMISSION_DENIED and
without a key UNAUTHENTICATED; with the admin key a path out of the root gets the same NOT_FOUND as a missing one,
and an adapter under the root loads and generates; a 7,000-character `x-request-id` leaves a bounded log line.
In-process, every management RPC of every API: tests/integration/test_admin_key.py."""

from __future__ import annotations

import grpc
import pytest

from tests.e2e.live_server import DEFAULT_MODEL, Proc, gen
from tests.lora_helpers import write_adapter
from tokenloop.v1 import tokenloop_pb2 as pb

USER, ADMIN = (("authorization", "Bearer user-key"),), (("authorization", "Bearer admin-key"),)
NOT_FOUND = ("LoRA adapter `{}`: `path` names no PEFT adapter under this server's --lora-root directories (not "
             "found, or not allowed)")


def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details()


def test_management_needs_the_admin_key_and_a_path_under_the_root(tmp_path):
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    write_adapter(DEFAULT_MODEL, root / "poet", r=4, seed=1)
    write_adapter(DEFAULT_MODEL, outside / "evil", r=4, seed=2)
    (root / "link").symlink_to(outside / "evil")
    (tmp_path / "api-keys").write_text("user-key\n")
    (tmp_path / "admin-keys").write_text("admin-key\n")
    server = Proc("--api-key-file", str(tmp_path / "api-keys"), "--admin-key-file", str(tmp_path / "admin-keys"),
                  "--lora-root", str(root), env={"TOKENLOOP_API_KEYS": ""})
    try:
        def load(name, path, metadata):
            return code_of(lambda: server.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=name, path=path),
                                                               metadata=metadata, timeout=60))

        assert load("poet", "poet", ())[0] == grpc.StatusCode.UNAUTHENTICATED
        assert load("poet", "poet", USER) == (grpc.StatusCode.PERMISSION_DENIED, "LoadLoraAdapter is a management "
                                              "RPC: it needs an admin key (--admin-key-file)")
        for name, path in (("missing", "nope"), ("dots", "../outside/evil"), ("link", "link"),
                           ("abs", str(outside / "evil"))):
            assert load(name, path, ADMIN) == (grpc.StatusCode.NOT_FOUND, NOT_FOUND.format(name))
        assert load("poet", "poet", ADMIN) == (grpc.StatusCode.OK, "")
        msgs = list(server.stub.Generate(gen(lora="poet", max_new=4), metadata=USER, timeout=120))
        assert msgs[-1].complete.usage.completion_tokens == 4
        long_id = "q" * 7000
        code, _ = code_of(lambda: list(server.stub.Generate(gen(), metadata=USER + (("x-request-id", long_id),),
                                                            timeout=60)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        server.proc.terminate()
        server.wait()
    finally:
        server.kill()
    refused = [line for line in server.lines if "q" * 256 in line]
    assert len(refused) == 1 and "...[cut: 7000 characters]" in refused[0] and len(refused[0]) < 1500
