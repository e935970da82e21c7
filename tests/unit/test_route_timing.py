"""engine/route_timing.py: re-timing the quantized routes on real steps, with a fake clock (made-up step times)."""

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


class Clock:
    """A fake clock: a step advances it by what the step cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(timer: RouteTimer, policy: Policy, clock: Clock, num_steps: int, cost, num_tokens=lambda i: 1) -> list:
    """`num_steps` steps (step i has num_tokens(i) rows and takes cost(route, i) on the fake clock); the routes
    they ran on."""
    ran = []
    for i in range(num_steps):
        rows = num_tokens(i)
        trial = timer.begin(rows)
        route = policy.qroutes[bucket_of(rows)]
        ran.append(route)
        clock.now += cost(route, i)
        timer.end(trial)
    return ran


def timer_on(policy: Policy, **kw) -> tuple[RouteTimer, Clock]:
    clock = Clock()
    return RouteTimer(policy, clock=clock, **kw), clock


def test_candidates_are_the_incumbents_family_on_one_and_two_threads():
    policy = Policy({1: (AVX2, False), 4: (AVX512, True), 16: (VNNI, True)})
    timer, _ = timer_on(policy)
    assert set(timer.candidates[1]) == {(AVX2, False), (AVX2, True), (AVX512, False), (AVX512, True)}
    assert set(timer.candidates[16]) == {(VNNI, False), (VNNI, True)}  # never another family: other bits


def test_equal_routes_never_switch_even_when_the_machine_speeds_up_and_slows_down():
    """Every route costs the same as its neighbours, while the machine's speed swings 3x over time (a quiet start,
    then load, then quiet): compared with the steps around them, no candidate is faster, so no switch."""
    policy = Policy({1: (AVX2, True)})
    timer, clock = timer_on(policy)
    load = lambda i: 1.0 if (i // 300) % 2 == 0 else 3.0  # noqa: E731
    ran = run_steps(timer, policy, clock, 3000, lambda route, i: 0.010 * load(i))
    assert timer.num_switches == 0 and policy.qroutes[1] == (AVX2, True)
    assert sum(r != (AVX2, True) for r in ran) == 3000 // 25  # one step in 25 tried a candidate
    assert sum(len(r) for r in timer.ratios.values()) > 0  # pairs were taken, and they said "equal"


def test_a_faster_candidate_takes_over_with_a_log_line(caplog):
    policy = Policy({1: (AVX2, True), 4: (AVX2, True)})  # two threads, timed on a busy machine
    timer, clock = timer_on(policy, period=10, window=5)
    cost = lambda route, i: 1.0 if route == (AVX2, True) else 0.6  # noqa: E731 - one thread is faster now
    with caplog.at_level(logging.INFO, logger="tokenloop.engine.route_timing"):
        ran = run_steps(timer, policy, clock, 400, cost)
    assert policy.qroutes[1][1] is False  # converged to one thread
    assert timer.num_switches >= 1 and "switch from int4-avx2 2 threads to" in caplog.text
    assert "median 0.600" in caplog.text  # the candidate's time over its neighbours' on the incumbent
    first_switch = next(i for i, r in enumerate(ran) if r != (AVX2, True) and i % 10 != 9)
    assert sum(r != policy.qroutes[1] for r in ran[first_switch:]) <= len(ran[first_switch:]) // 10 + 1
    assert policy.qroutes[4] == (AVX2, True)  # another bucket's route is untouched


def test_a_candidate_tried_while_the_machine_was_quiet_does_not_win_on_that():
    """The bias the pairing removes: the candidates' trials fall in a quiet spell (steps 2x faster for everyone)
    while most incumbent steps ran under load. Compared with their neighbours, the candidates are equal: no switch."""
    policy = Policy({1: (AVX512, False)})
    timer, clock = timer_on(policy, period=5, window=5)

    def cost(route, i):
        quiet = i % 5 in (3, 4, 0)  # the trial (i % 5 == 4) and its neighbours run in the quiet spell
        return 0.5 if quiet else 1.0
    run_steps(timer, policy, clock, 500, cost)
    assert timer.num_switches == 0 and policy.qroutes[1] == (AVX512, False)


def test_pairs_need_the_same_number_of_rows():
    """A trial step whose neighbours had other row counts (a different amount of work) yields no ratio."""
    policy = Policy({16: (AVX2, False)})
    timer, clock = timer_on(policy, period=5, window=3)
    rows = lambda i: 16 if i % 5 == 4 else 9  # noqa: E731 - the trials always have 16 rows, the others 9
    run_steps(timer, policy, clock, 500, lambda route, i: 0.1 if route != (AVX2, False) else 1.0, rows)
    assert timer.num_switches == 0 and not any(timer.ratios.values())


def test_the_incumbent_stays_when_nothing_is_faster():
    policy = Policy({1: (AVX512, False)})
    timer, clock = timer_on(policy, period=5, window=5)
    ran = run_steps(timer, policy, clock, 300, lambda route, i: 1.0 if route == (AVX512, False) else 1.02)
    assert policy.qroutes[1] == (AVX512, False) and timer.num_switches == 0
    trials = sum(r != (AVX512, False) for r in ran)
    assert trials == 300 // 5  # one step in five tried a candidate, and each put the incumbent back
    assert {r for r in ran if r != (AVX512, False)} <= set(timer.candidates[1])


def test_a_bucket_with_one_candidate_never_tries():
    policy = Policy({1: (VNNI, False)})
    timer, clock = timer_on(policy, period=1, window=2)
    timer.candidates[1] = [(VNNI, False)]
    ran = run_steps(timer, policy, clock, 20, lambda route, i: 1.0)
    assert set(ran) == {(VNNI, False)}


def test_buckets_are_the_calibrations():
    assert [bucket_of(n) for n in (1, 2, 4, 5, 64, 65, 5000)] == [1, 4, 4, 16, 64, 256, 1024]
