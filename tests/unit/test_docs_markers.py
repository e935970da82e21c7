"""The docs check, part 1: every fenced block names its language and every shell block says who runs it.

Part 2, running the `run` blocks, is tests/e2e/test_docs_commands.py; the rules are in tests/docs_check.py.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.docs_check import (
    Block,
    all_blocks,
    bare_tools,
    blocks,
    doc_files,
    parse_marker,
    port_map,
    problems,
    run_spec,
    substitute_ports,
)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.name)
def test_every_block_of_readme_and_docs_complies(path):
    bad = [p for block in blocks(path) for p in problems(block)]
    assert not bad, "\n".join(bad)


def test_there_is_something_to_run():
    verbs = [parse_marker(b.marker)[0] for b in all_blocks() if b.is_shell]
    assert verbs.count("run") >= 10


def doc(tmp_path, text: str) -> list[Block]:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return blocks(path)


def test_markers_are_read_from_the_line_above(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.docs_check.ROOT", tmp_path)
    found = doc(tmp_path, "Intro\n<!-- docs-check: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n\n```text\nout\n```\n")
    assert [(b.line, b.language, b.marker) for b in found] == [(3, "bash", "skip needs a GPU"), (7, "text", None)]
    assert problems(found[0], tmp_path) == [] and problems(found[1], tmp_path) == []


@pytest.mark.parametrize(("text", "message"), [
    ("```\nls\n```\n", "doc.md:1: a fenced block must name its language (```bash, ```text, ...)"),
    ("```bash\nls\n```\n", "doc.md:1: a bash block needs a marker on the line above it"),
    ("<!-- docs-check: skip -->\n```sh\nls\n```\n", "doc.md:2: skip needs a reason"),
    ("<!-- docs-check: covered-by tests/nope.py -->\n```bash\nls\n```\n",
     "doc.md:2: covered-by needs one existing path in the repository; got ['tests/nope.py']"),
    ("<!-- docs-check: run loudly -->\n```bash\nls\n```\n", "doc.md:2: unknown `run` option 'loudly'"),
    ("<!-- docs-check: maybe -->\n```console\n$ ls\n```\n", "doc.md:2: the marker must start with one of run"),
    ("<!-- docs-check: run -->\n```bash\necho hi | tokenloop-cli generate -\n```\n",
     "doc.md:2: write the path of `tokenloop-cli`: .venv/bin/tokenloop-cli (a new shell has no virtualenv on PATH)"),
    ("<!-- docs-check: covered-by doc.md -->\n```console\n$ python3 -c 1 && grpcurl x\n```\n",
     "doc.md:2: write the path of `python3`, `grpcurl`: .venv/bin/python3, .venv/bin/grpcurl"),
])
def test_each_rule_has_its_message(tmp_path, monkeypatch, text, message):
    monkeypatch.setattr("tests.docs_check.ROOT", tmp_path)
    [block] = doc(tmp_path, text)
    [problem] = problems(block, tmp_path)
    assert problem.startswith(message)


def test_run_options_and_transcripts(tmp_path):
    spec = run_spec(["own-server", "errexit=off", "timeout=60", 'expect=exit code 1', "expect=Paris"])
    assert (spec.own_server, spec.errexit, spec.timeout, spec.expect) == (True, False, 60.0, ["exit code 1", "Paris"])
    [block] = doc(tmp_path, "<!-- docs-check: run -->\n```console\n$ echo hi\nhi\n$ ls\n```\n")
    assert block.commands() == "echo hi\nls"


def test_ports_point_at_the_shared_server_or_at_free_ones():
    text = "tokenloop-cli --address localhost:50051 info; curl 127.0.0.1:30000/x; echo 500510"
    free = iter([41000, 41001])
    mapping = port_map(text, 7777, lambda: next(free))
    assert mapping == {50051: 7777, 30000: 41000}
    assert substitute_ports(text, mapping) == "tokenloop-cli --address localhost:7777 info; curl 127.0.0.1:41000/x; " \
                                               "echo 500510"


@pytest.mark.parametrize(("text", "bare"), [
    ("tokenloop-cli info", ["tokenloop-cli"]), (".venv/bin/tokenloop-cli info", []),
    ("FOO=1 tokenloop serve --port 1 &", ["tokenloop"]), ("make serve   # runs tokenloop serve", []),
    ("cd x && python -m y | buf curl z", ["python", "buf"]), ("echo tokenloop-cli", []),
    ("source .venv/bin/activate\ntokenloop-cli info", []), ("x=$(pip freeze)", ["pip"]),
])
def test_bare_tools_are_found_in_command_position(text, bare):
    assert bare_tools(text) == bare


def test_blocks_run_without_the_virtualenv_on_path(monkeypatch):
    from tests.docs_check import VENV_BIN, environment
    monkeypatch.setenv("PATH", f"{VENV_BIN}:/usr/bin:/bin")
    monkeypatch.setenv("VIRTUAL_ENV", str(VENV_BIN.parent))
    env = environment("127.0.0.1:1", 1)
    assert str(VENV_BIN) not in env["PATH"].split(":") and "VIRTUAL_ENV" not in env
    bare = subprocess.run(["bash", "-c", "tokenloop-cli --version"], env=env, capture_output=True, text=True)
    spelled = subprocess.run(["bash", "-c", ".venv/bin/tokenloop-cli --version"], env=env, capture_output=True,
                             text=True, cwd=VENV_BIN.parent.parent)
    assert bare.returncode == 127  # command not found: a block that forgets the path fails the docs check
    assert (spelled.returncode, spelled.stdout) == (0, "tokenloop-cli 0.1.0\n")
