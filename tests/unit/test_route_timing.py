"""engine/route_timing.py: re-timing the quantized routes on real steps, with made-up step times."""

from __future__ import annotations

import logging

from tokenloop.engine.route_timing import RouteTimer, bucket_of


class Route:
    def __init__(self, name: str, family: str):
        self.name, self.family = name, family


AVX2, AVX512, VNNI = Route("int4-avx2", "exact"), Route("int4-avx512", "exact"), Route("int4-vnni", "vnni")


class Policy:
    """What RouteTimer reads and writes of a MatmulPolicy: its per-bucket (route, split)."""

    def __init__(self, qroutes):
        self.qroutes = qroutes


def run_steps(timer: RouteTimer, policy: Policy, num_steps: int, cost, num_tokens: int = 1) -> list:
    """`num_steps` steps of `num_tokens` rows, each taking cost(route it ran on) seconds; the routes they ran."""
    ran = []
    for _ in range(num_steps):
        trial = timer.begin(num_tokens)
        route = policy.qroutes[bucket_of(num_tokens)]
        ran.append(route)
        timer.end(trial, cost(route))
    return ran


def test_candidates_are_the_incumbents_family_on_one_and_two_threads():
    policy = Policy({1: (AVX2, False), 4: (AVX512, True), 16: (VNNI, True)})
    timer = RouteTimer(policy)
    assert set(timer.candidates[1]) == {(AVX2, False), (AVX2, True), (AVX512, False), (AVX512, True)}
    assert set(timer.candidates[16]) == {(VNNI, False), (VNNI, True)}  # never another family: other bits


def test_a_faster_candidate_takes_over_and_trials_stay_rare(caplog):
    policy = Policy({1: (AVX2, True), 4: (AVX2, True)})  # two threads, timed on a busy machine
    timer = RouteTimer(policy, period=10, window=5)
    cost = lambda route: 1.0 if route == (AVX2, True) else 0.6  # noqa: E731 - one thread is faster now
    with caplog.at_level(logging.INFO, logger="tokenloop.engine.route_timing"):
        ran = run_steps(timer, policy, 400, cost)
    assert policy.qroutes[1][1] is False  # converged to one thread
    assert timer.num_switches >= 1 and "switch from int4-avx2 2 threads to" in caplog.text
    first_switch = next(i for i, r in enumerate(ran) if r != (AVX2, True) and i % 10 != 9)
    assert sum(r != policy.qroutes[1] for r in ran[first_switch:]) <= len(ran[first_switch:]) // 10 + 1
    assert policy.qroutes[4] == (AVX2, True)  # another bucket's route is untouched


def test_the_incumbent_stays_when_nothing_is_faster():
    policy = Policy({1: (AVX512, False)})
    timer = RouteTimer(policy, period=5, window=5)
    ran = run_steps(timer, policy, 300, lambda route: 1.0 if route == (AVX512, False) else 1.02)
    assert policy.qroutes[1] == (AVX512, False) and timer.num_switches == 0
    trials = sum(r != (AVX512, False) for r in ran)
    assert trials == 300 // 5  # one step in five tried a candidate, and each put the incumbent back
    assert {r for r in ran if r != (AVX512, False)} <= set(timer.candidates[1])


def test_a_bucket_with_one_candidate_never_tries():
    policy = Policy({1: (VNNI, False)})
    timer = RouteTimer(policy, period=1, window=2)
    timer.candidates[1] = [(VNNI, False)]
    ran = run_steps(timer, policy, 20, lambda route: 1.0)
    assert set(ran) == {(VNNI, False)}


def test_buckets_are_the_calibrations():
    assert [bucket_of(n) for n in (1, 2, 4, 5, 64, 65, 5000)] == [1, 4, 4, 16, 64, 256, 1024]
