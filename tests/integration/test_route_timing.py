"""--route-retiming (engine/route_timing.py) in a running engine: trial steps on other routes of the calibrated
family give the same bits, so the same tokens as an engine that never re-times."""

from __future__ import annotations

import random

import pytest

from tests.engine_helpers import greedy_request, run_all, tokens
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine


def prompts(vocab: int, count: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def engine(checkpoint, **config) -> Engine:
    return Engine.from_dir(checkpoint, EngineConfig(dtype="float32", kv_cache_tokens=4096, **config))



@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_route_retiming_changes_no_token(tmp_path, weights):
    """--route-retiming runs steps on other routes of the calibrated family (here every other step, to try them all
    many times): the same bits, so the same greedy tokens as a server that never re-times."""
    checkpoint = make_tiny_model(tmp_path / "m", "llama", tied=False, num_layers=2, std=1.0, vocab_size=64)
    reqs = [greedy_request(p, 32) for p in prompts(64, 4)]
    results = []
    for retime in (False, True):
        eng = engine(checkpoint, weights=weights, route_retiming=retime)
        try:
            if retime:
                assert eng.route_timer is not None
                eng.route_timer.period = 2
                assert any(len(c) > 1 for c in eng.route_timer.candidates.values())  # one and two threads at least
            else:
                assert eng.route_timer is None
            ids, steps = run_all(eng, reqs)
            results.append([tokens(steps[(i, 0)]) for i in ids])
            if retime:
                assert sum(eng.route_timer.counts.values()) > 20
        finally:
            eng.shutdown()
    assert results[0] == results[1]
