"""The docs check, part 1: every fenced block names its language and every shell block says who runs it.

Part 2, running the `run` blocks, is tests/e2e/test_docs_commands.py; the rules are in tests/docs_check.py.
"""

from __future__ import annotations

import pytest

from tests.docs_check import Block, all_blocks, blocks, parse_marker, port_map, problems, run_spec, substitute_ports


def test_every_block_of_readme_and_docs_complies():
    bad = [p for block in all_blocks() for p in problems(block)]
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
