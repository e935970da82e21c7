"""The docs check: every shell command in README.md and docs/*.md is run, or says who runs it, or why not.

Rules (README.md "Docs that run as written"):

- Every fenced block names its language (```bash, ```python, ```text, ...). Shell blocks are ```bash, ```sh,
  ```shell and ```console (a transcript: its `$ ` lines are the commands).
- The line just above every shell block is one marker comment (invisible on GitHub):
    <!-- docs-check: run [own-server] [errexit=off] [timeout=S] [expect="TEXT"]... -->
        the check runs the block with bash and requires exit status 0 (errexit=off: a block that shows a
        failure runs without `set -e` and its status is not checked) and each TEXT in its output;
    <!-- docs-check: covered-by PATH -->     a test or script in this repository runs these commands;
    <!-- docs-check: skip REASON -->         not run here, and why (a GPU, Kubernetes, systemd, another host).
- A `run` or `covered-by` block spells the path of every tool that `make setup` / `make setup-dev` installs
  (`.venv/bin/tokenloop-cli`, `.venv/bin/python`, `.venv/bin/grpcurl`, `.venv/bin/buf`, ...), so that it works
  pasted into a new shell after `make setup` and `make model`, with no virtualenv activated (a block may activate
  one itself with `source .venv/bin/activate`).
- How `run` blocks run (tests/e2e/test_docs_commands.py): bash, `set -e -o pipefail` unless errexit=off, from a
  scratch directory that links every top-level entry of the repository (so `.venv/bin/...`, `models/...`,
  `make ...` work and files a block writes stay out of the tree), as a new shell would: `.venv/bin` is not on
  PATH and no virtualenv is active (buf is reached at `.venv/bin/buf`, which `make setup-dev` links). One shared
  `tokenloop serve` with the default model answers blocks without `own-server`: the ports 50051 in them and
  $TOKENLOOP_ADDRESS point at it. A block marked `own-server` starts its servers itself (with `&`); each port
  number it names from `PORTS` becomes a free port for that run (and $PORT, which `make serve` reads, the one
  for 50051). Whatever a block left running is stopped when it ends.

Figures: a number the README or docs/ state as measured is tied to a results file by a marker after it
(`<!-- figure NAME -->`, computed by bench/figures.py), sits in a table rendered from one
(`<!-- figures table NAME -->`), or is marked as history (`<!-- history DATE COMMIT -->`); `figure_problems()` fails
when the text and the results file disagree (bench/README.md).

`python tests/docs_check.py` lists every shell block with its marker, then every figure that disagrees.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
PORTS = (50051, 50052, 50151, 9464, 30000)  # ports the docs use; own-server blocks get free ones instead
VERBS = ("run", "covered-by", "skip")
# what `make setup` / `make setup-dev` put in .venv/bin: a block names them by that path, never bare
VENV_TOOLS = ("tokenloop-cli", "tokenloop-bench", "tokenloop", "python3", "python", "pip", "pytest", "ruff", "grpcurl", "smg", "buf")
_BARE_TOOL = re.compile(r"(?:^|[|;&(]\s*|\$\(\s*|\b(?:then|do|else|time|exec|nohup|timeout \S+)\s+)"
                        r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(" + "|".join(map(re.escape, VENV_TOOLS)) + r")(?=\s|$)")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    """One fenced block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str | None  # the marker comment's content, when the line above is one

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL_LANGUAGES

    def commands(self) -> str:
        """The shell text to run: a transcript's `$ ` lines, or the whole block."""
        if self.language != "console":
            return self.text
        return "\n".join(line[2:] for line in self.text.splitlines() if line.startswith("$ "))


@dataclass
class RunSpec:
    """A `run` marker's options."""

    own_server: bool = False
    errexit: bool = True
    timeout: float = 300.0
    expect: list[str] = field(default_factory=list)


def environment(address: str, port_for_50051: int) -> dict[str, str]:
    """A new shell's environment after `make setup` and `make model`: no virtualenv active, `.venv/bin` not on PATH
    (even when the tests run from an activated one), so a block that names a tool without its path fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX")}
    venvs = {str(VENV_BIN), os.path.join(os.environ.get("VIRTUAL_ENV", str(ROOT / ".venv")), "bin")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) not in {os.path.realpath(v) for v in venvs})
    env.update(TOKENLOOP_ADDRESS=address, PORT=str(port_for_50051), PYTHONUNBUFFERED="1")
    env.pop("TOKENLOOP_API_KEY", None)
    return env


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path`, with the marker comment on the line above it (if any)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        above = _MARKER.match(lines[start - 1]) if start > 0 else None
        out.append(Block(path, start + 1, m.group(3), "\n".join(lines[start + 1:i]),
                         above.group(1) if above else None))
        i += 1
    return out


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for path in doc_files(root) for b in blocks(path)]


def parse_marker(marker: str) -> tuple[str, list[str]]:
    """(verb, arguments) of a marker; ValueError when it is malformed."""
    verb, _, rest = marker.strip().partition(" ")
    if verb not in VERBS:
        raise ValueError(f"the marker must start with one of {', '.join(VERBS)}; got {marker!r}")
    return verb, shlex.split(rest) if verb == "run" else rest.split()


def run_spec(args: list[str]) -> RunSpec:
    spec = RunSpec()
    for arg in args:
        key, _, value = arg.partition("=")
        if arg == "own-server":
            spec.own_server = True
        elif key == "errexit" and value in ("on", "off"):
            spec.errexit = value == "on"
        elif key == "timeout" and value.replace(".", "", 1).isdigit():
            spec.timeout = float(value)
        elif key == "expect" and value:
            spec.expect.append(value)
        else:
            raise ValueError(f"unknown `run` option {arg!r} (own-server, errexit=off, timeout=S, expect=\"TEXT\")")
    return spec


def problems(block: Block, root: Path = ROOT) -> list[str]:
    """What breaks the rules in one block (empty when it complies)."""
    if not block.language:
        return [f"{block.name}: a fenced block must name its language (```bash, ```text, ...)"]
    if not block.is_shell:
        return []
    if block.marker is None:
        return [f"{block.name}: a {block.language} block needs a marker on the line above it: "
                "<!-- docs-check: run | covered-by PATH | skip REASON --> (see tests/docs_check.py)"]
    try:
        verb, args = parse_marker(block.marker)
        if verb == "run":
            run_spec(args)
        elif verb == "covered-by" and (len(args) != 1 or not (root / args[0]).exists()):
            return [f"{block.name}: covered-by needs one existing path in the repository; got {args}"]
        elif verb == "skip" and not args:
            return [f"{block.name}: skip needs a reason"]
    except ValueError as exc:
        return [f"{block.name}: {exc}"]
    bare = bare_tools(block.commands()) if verb in ("run", "covered-by") else []
    if bare:
        return [f"{block.name}: write the path of {', '.join(f'`{t}`' for t in bare)}: "
                f"{', '.join(f'.venv/bin/{t}' for t in bare)} (a new shell has no virtualenv on PATH)"]
    return []


def bare_tools(text: str) -> list[str]:
    """The `.venv/bin` tools a shell text runs by bare name (comments and `source .venv/bin/activate` blocks aside)."""
    if re.search(r"(^|\s)(source|\.) \.?/?\.venv/bin/activate", text):
        return []
    found = []
    for line in text.splitlines():
        code = re.sub(r"(^|\s)#.*$", "", line)  # a comment
        found += [m.group(1) for m in _BARE_TOOL.finditer(code) if m.group(1) not in found]
    return found


def port_map(text: str, shared_port: int | None, free_port) -> dict[int, int]:
    """The replacement of each port in `PORTS` that `text` names: the shared server's for 50051 unless the block
    runs its own servers, else a free one."""
    mapping = {}
    for port in PORTS:
        if re.search(rf"(?<!\d){port}(?!\d)", text) or port == 50051:
            mapping[port] = shared_port if (port == 50051 and shared_port) else free_port()
    return mapping


def substitute_ports(text: str, mapping: dict[int, int]) -> str:
    for old, new in mapping.items():
        text = re.sub(rf"(?<!\d){old}(?!\d)", str(new), text)
    return text


def figure_problems(root: Path = ROOT) -> list[str]:
    """Where a figure of README.md or docs/*.md disagrees with its results file, a rendered table is stale, or a
    measured number in the README's Measured and Features sections is neither tied to a results file nor marked as
    history (the markers: bench/figures.py, bench/README.md)."""
    from tokenloop.bench import figures
    return [p for path in doc_files(root) for p in figures.problems(path, root)]


def main() -> int:
    bad = []
    for block in all_blocks():
        if block.is_shell:
            print(f"{block.name:32} {block.language:8} {block.marker or '(no marker)'}")
        bad += problems(block)
    bad += figure_problems()
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
