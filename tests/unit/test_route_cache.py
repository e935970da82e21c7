"""The calibrations' cache (engine/matmul.py calibrate_quant and calibrate): a choice is timed once per CPU, kernel
build and weight shape, and one timed on a busy machine is provisional."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tokenloop.engine import calibration, kernels, matmul
from tokenloop.engine.calibration import CACHE_ENV
from tokenloop.engine.matmul import Backend, MatmulPolicy
from tokenloop.engine.quant import quantize
from tokenloop.engine.quant_routes import ROUTE_ENV


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="OthersLoad reads /proc/stat (Linux)")
def test_others_load_sees_a_busy_process_and_not_this_one():
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child is running
        load = calibration.OthersLoad()
        time.sleep(0.8)
        share = load.share()
    finally:
        busy.wait()
    # one spinning process holds one CPU: 1 / cpu_count of the machine, less whatever the scheduler took from it
    assert share is not None and share > 0.5 / (os.cpu_count() or 1)
    load = calibration.OthersLoad()  # this process's own work is not the others'
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    assert load.share() < share


class FakeLoad:
    share_of_others = 0.0

    def share(self):
        return self.share_of_others


@pytest.fixture()
def calibrate(tmp_path, monkeypatch):
    int8 = kernels.load_int8()
    if int8 is None:
        pytest.skip("the int8 C kernel cannot be built here")
    monkeypatch.setattr(matmul, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(calibration, "OthersLoad", FakeLoad)
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    weights = [quantize(torch.randn(64, 32), 32) for _ in range(2)]
    return lambda: MatmulPolicy.calibrate_quant("int8", weights, int8)


def test_a_choice_timed_on_a_quiet_machine_is_cached(calibrate, monkeypatch):
    first = calibrate()
    assert first.chosen.startswith("timed in") and "provisional" not in first.chosen
    monkeypatch.setattr(calibration, "quiet_now", lambda: True)
    assert calibrate().chosen.startswith("cached in")


def test_a_choice_timed_under_load_is_timed_again_on_a_quiet_start(calibrate, monkeypatch, caplog):
    monkeypatch.setattr(FakeLoad, "share_of_others", 0.6)
    first = calibrate()
    assert "other processes used 60% of the CPUs: cached as provisional" in first.chosen
    assert "cached as provisional" in caplog.text
    monkeypatch.setattr(calibration, "quiet_now", lambda: False)  # still busy: the provisional choice serves
    busy = calibrate()
    assert busy.chosen.startswith("cached in") and "timed while other processes used 60% of the CPUs" in busy.chosen
    monkeypatch.setattr(calibration, "quiet_now", lambda: True)
    monkeypatch.setattr(FakeLoad, "share_of_others", 0.02)
    quiet = calibrate()  # re-timed, and now cached for good
    assert quiet.chosen.startswith("timed in") and "timed under load" in quiet.chosen
    assert calibrate().chosen.startswith("cached in") and "provisional" not in calibrate().chosen


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="OthersLoad reads /proc/stat (Linux)")
def test_a_machine_with_a_busy_process_is_not_quiet():
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        assert not calibration.quiet_now()
    finally:
        busy.wait()


def test_the_float32_choice_is_cached_as_the_quantized_one(tmp_path, monkeypatch):
    """fp32's backends per bucket (MatmulPolicy.calibrate) are timed once and read back at the next start: the same
    backends, so the same bits, without the timing; a damaged file is timed again."""
    monkeypatch.setattr(matmul, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(calibration, "OthersLoad", FakeLoad)
    monkeypatch.delenv(CACHE_ENV, raising=False)
    weights = [torch.randn(64, 32) for _ in range(2)]
    first = MatmulPolicy.calibrate(weights)
    assert first.chosen.startswith("timed in") and first.chosen in first.describe()
    monkeypatch.setattr(matmul, "fastest", lambda *args, **kwargs: pytest.fail("timed again"))
    again = MatmulPolicy.calibrate(weights)
    assert again.chosen.startswith("cached in") and again.buckets == first.buckets
    [path] = tmp_path.glob("matmul-float32-*.json")
    path.write_text('{"buckets": {"1": "torch"}}')  # a bucket short
    monkeypatch.setattr(matmul, "fastest", lambda candidates, rounds=7: Backend.TORCH)
    retimed = MatmulPolicy.calibrate(weights)
    assert retimed.chosen.startswith("timed in") and set(retimed.buckets.values()) == {Backend.TORCH}
    assert MatmulPolicy.calibrate(weights).chosen.startswith("cached in")
    assert MatmulPolicy.calibrate(weights, use_cache=False).chosen.startswith("timed in")
    assert MatmulPolicy.calibrate([w.double() for w in weights]).chosen.startswith("timed in")  # another key
