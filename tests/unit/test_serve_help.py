"""`tokenloop serve --help` and its configuration errors: every flag explained once, errors naming the flag."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tokenloop.service.cli import build_parser, config_from_args, main


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_flag_has_help_and_its_default_once():
    parser = serve_parser()
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert bare == []
    text = parser.format_help()
    assert "(default: None)" not in text
    for block in re.split(r"\n  (?=-)", text):
        assert block.count("(default:") <= 1, block


@pytest.mark.parametrize("flag", ["--port", "--host", "--backend", "--max-concurrent-requests", "--dtype"])
def test_the_flags_a_user_reads_first_say_what_they_do(flag):
    action = next(a for a in serve_parser()._actions if flag in a.option_strings)
    assert len(action.help) > 20


def test_int8_help_quotes_the_measured_perplexity():
    action = next(a for a in serve_parser()._actions if "--weights" in a.option_strings)
    assert "+0.3%% against fp32" in action.help  # docs/engine.md: fp32 29.95, int8 30.04 (+0.31 %)


def test_version():
    run = subprocess.run([sys.executable, "-m", "service.cli", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert (run.returncode, run.stdout) == (0, "tokenloop 0.1.0\n")


@pytest.mark.parametrize(("flags", "message"), [
    (["--default-max-new-tokens", "0"], "--default-max-new-tokens must be between 1 and --max-new-tokens (4096); got 0"),
    (["--max-new-tokens", "100", "--default-max-new-tokens", "200"],
     "--default-max-new-tokens must be between 1 and --max-new-tokens (100); got 200"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1; got 0"),
    (["--max-n", "0"], "--max-n must be >= 1; got 0"),
    (["--max-stop-strings", "-1"], "--max-stop-strings must be >= 0; got -1"),
    (["--metrics-port", "70000"], "--metrics-port must be between 0 and 65535; got 70000"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1; got 0"),
    (["--num-threads", "0"], "--num-threads must be >= 1; got 0"),
    (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction must be > 0 and <= 1; got 1.5"),
])
def test_configuration_errors_name_the_flag(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err == f"tokenloop: {message}\n"


def test_a_small_max_new_tokens_lowers_the_default_instead_of_failing():
    config = config_from_args(build_parser().parse_args(["serve", "--max-new-tokens", "50"]))
    assert (config.max_new_tokens, config.default_max_new_tokens) == (50, 50)


def test_the_help_points_where_the_readme_does():
    """docs/server.md has every flag (the README's pointer); serve --help named docs/operations.md (issue 44)."""
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert "docs/server.md has them all" in serve.description and parser.epilog.endswith("docs/server.md")
    assert "[docs/server.md](docs/server.md): every flag" in (ROOT / "README.md").read_text()
