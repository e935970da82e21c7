"""Structured output in the Python client and tokenloop-cli: each option lands in its proto field."""

from __future__ import annotations

import json

import pytest

from tests.integration.client_fakes import FlakyServicer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("name, value, expected", [
    ("json_schema", SCHEMA, json.dumps(SCHEMA)),
    ("json_schema", '{"type": "string"}', '{"type": "string"}'),
    ("json_object", True, True),
    ("regex", "[a-z]+", "[a-z]+"),
    ("grammar", 'root ::= "a"', 'root ::= "a"'),
    ("structural_tag", {"structures": [], "triggers": []}, json.dumps({"structures": [], "triggers": []})),
])
def test_each_structured_option_lands_in_its_oneof_field(name, value, expected):
    from tokenloop_client._request import build_generate

    req = build_generate("x", stream=False, params={name: value})
    assert req.WhichOneof("structured") == name and getattr(req, name) == expected


def test_two_structured_options_or_a_wrong_type_are_refused_by_the_client():
    from tokenloop_client import ParameterError
    from tokenloop_client._request import build_generate

    with pytest.raises(ParameterError, match="give at most one of json_schema, json_object, regex, grammar, "
                                             "structural_tag; got json_schema, regex") as err:
        build_generate("x", stream=False, params={"json_schema": SCHEMA, "regex": "a"})
    assert err.value.parameter == "regex"
    with pytest.raises(ParameterError, match=r"`regex` must be a string; got 5 \(int\)"):
        build_generate("x", stream=False, params={"regex": 5})
    assert build_generate("x", stream=False, params={"json_object": False}).WhichOneof("structured") is None


def test_cli_json_schema_file_and_regex(fake, tmp_path, capsys):  # noqa: F811 - the fixture
    from tokenloop_client import cli

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    servicer = FlakyServicer(num_failures=0)
    address = fake(servicer)
    assert cli.main(["--address", address, "generate", "x", "--json-schema", str(schema_file)]) == 0
    assert cli.main(["--address", address, "generate", "x", "--regex", "[0-9]+"]) == 0
    assert cli.main(["--address", address, "generate", "x", "--json-object"]) == 0
    first, second, third = servicer.requests
    assert first.WhichOneof("structured") == "json_schema" and json.loads(first.json_schema) == SCHEMA
    assert second.WhichOneof("structured") == "regex" and second.regex == "[0-9]+"
    assert third.WhichOneof("structured") == "json_object" and third.json_object
    capsys.readouterr()
    missing = tmp_path / "missing.json"
    assert cli.main(["--address", address, "generate", "x", "--json-schema", str(missing)]) == 2  # a usage error
    assert capsys.readouterr().err == f"tokenloop-cli: error: --json-schema {missing}: No such file or directory\n"
    with pytest.raises(SystemExit):  # argparse: not allowed with argument --regex
        cli.main(["--address", address, "generate", "x", "--regex", "a", "--json-object"])
    assert "not allowed with argument" in capsys.readouterr().err
