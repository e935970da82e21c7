"""The command-line tools the e2e tests drive as a user would: `tokenloop-cli` and `buf curl`.

The `buf` fixture that finds (or installs) buf is in tests/e2e/conftest.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.live_server import ROOT

BUF_VERSION = "1.75.0"
BUF_PREFIX = ROOT / ".cache" / "buf"
GRPC = ("--protocol", "grpc", "--http2-prior-knowledge")


def cli_command() -> list[str]:
    """tokenloop-cli: the console script when installed, else the module from the source tree."""
    script = Path(sys.executable).parent / "tokenloop-cli"
    if script.exists():
        return [str(script)]
    code = "import sys; sys.path.insert(0, 'clients/python'); from tokenloop_client.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run tokenloop-cli to the end."""
    return subprocess.run([*cli_command(), *args], cwd=ROOT, check=False, capture_output=True, text=True,
                          timeout=timeout)


def curl(buf: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Run `buf curl` in an empty directory (no proto files anywhere near)."""
    return subprocess.run([buf, "curl", *GRPC, *args], cwd=tmp_path, check=False, capture_output=True, text=True,
                          timeout=300)


def messages(stdout: str) -> list[dict]:
    """buf curl prints one JSON document per response message."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    text = stdout.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        out.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out
