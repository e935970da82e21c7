"""scripts/front_instructions.py end to end, small: both servers under callgrind, a positive count per message for
each, its busiest threads (--threads) and the ratio line. Counts are printed, never asserted beyond being counted
(docs/performance.md quotes a run)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="valgrind (with callgrind_control) is not installed: apt-get install valgrind")
def test_front_instructions_counts_both_servers_per_message(tokenizer_dir):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "front_instructions.py"), "--model",
                          str(tokenizer_dir), "--streams", "2", "--tokens", "16", "--threads"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(re.findall(r"^(bare|full)\s+32\s+[\d,]+\s+([\d,]+)$", out.stdout, re.M))
    assert set(rows) == {"bare", "full"}, out.stdout
    assert all(int(v.replace(",", "")) > 0 for v in rows.values()), out.stdout
    assert re.search(r"^full / bare: \d+\.\d\dx", out.stdout, re.M), out.stdout
    # --threads: each server's busiest threads, the main thread (1: the event loop) among them
    threads = re.findall(r"^ +per message by thread: (.+)$", out.stdout, re.M)
    assert len(threads) == 2 and all(re.search(r"(^|, )1: [\d,]+", t) for t in threads), out.stdout
