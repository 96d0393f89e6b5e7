"""The scheduler alone, with a controllable clock: ordering, deadlines, breaker, admission, chunks."""

import pytest

from o3edge.engine.block_manager import BlockManager
from o3edge.engine.breaker import CLOSED, HALF_OPEN, OPEN
from o3edge.engine.scheduler import Scheduler
from o3edge.engine.sequence import Priority, SamplingParams, Sequence
from o3edge.errors import Busy
from o3edge.policy import ClassLimits, Policy, SchedulerPolicy

C, H, N, L = Priority.CRITICAL, Priority.HIGH, Priority.NORMAL, Priority.LOW


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(num_blocks=64, max_seqs=8, budget=64, classes=None, **queue):
    clock = Clock()
    policy = Policy(classes=classes or SchedulerPolicy(), **queue)
    sched = Scheduler(BlockManager(num_blocks, 4, "m"), max_seqs, budget, policy, clock=clock)
    return sched, clock


def seq(name, n=4, priority=N, deadline=None, arrival=0.0, first=0):
    s = Sequence(name, list(range(first, first + n)), SamplingParams(), priority, deadline)
    s.arrival_time = arrival
    return s


def step(sched, batch, sampled=True):
    """What the engine does after a step: mark computed, append a token where the prompt is done."""
    for s, n in batch:
        sched.blocks.mark_computed(s, n)
        if sampled and s.num_computed_tokens == len(s):
            s.token_ids.append(7)


def names(batch):
    return [s.request_id for s, _ in batch]


def test_order_is_class_then_deadline_then_arrival():
    sched, _ = make(max_seqs=3)
    for s in (seq("low", priority=L, arrival=1), seq("n-late", deadline=500, arrival=2),
              seq("n-early", deadline=200, arrival=3), seq("n-none", arrival=0), seq("crit", priority=C, arrival=9)):
        sched.add(s)
    assert names(sched.schedule()) == ["crit", "n-early", "n-late"]


def test_expired_in_queue_never_runs_and_running_ones_stop():
    sched, clock = make(max_seqs=1)
    a, b = seq("a", deadline=101.0), seq("b", deadline=102.0)
    sched.add(a)
    sched.add(b)
    step(sched, sched.schedule())  # a runs, b waits (one slot)
    clock.t = 101.5
    batch = sched.schedule()
    assert [s.request_id for s in sched.expired] == ["a"] and a.finish_reason == "deadline_exceeded"
    assert names(batch) == ["b"]
    clock.t = 103
    sched.schedule()
    assert b.finish_reason == "deadline_exceeded" and not sched.has_work()
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_breaker_opens_after_threshold_timeouts_degrades_then_recovers():
    classes = SchedulerPolicy(ClassLimits(50, 1, 2, breaker_cooldown_ms=1000), ClassLimits(200, 8, 5),
                              ClassLimits(1000, 8, 10), ClassLimits(5000, 8, 20))
    sched, clock = make(classes=classes)
    hog = seq("hog", priority=C)
    sched.add(hog)
    step(sched, sched.schedule())  # the one critical slot is taken
    waiting = [seq(f"c{i}", priority=C) for i in range(2)]
    for s in waiting:
        sched.add(s)
    clock.t += 0.06  # both wait past the 50 ms budget
    sched.schedule()
    br = sched.breakers[C]
    assert br.current(clock.t) == OPEN and br.times_opened == 1
    late = seq("late", priority=C)
    sched.add(late)
    assert late.priority == H and late.requested_priority == C  # degraded one class while open
    clock.t += 1.0
    assert br.current(clock.t) == HALF_OPEN
    for s in [hog, late, *waiting]:
        sched.finish(s, "stop")
    fresh = seq("fresh", priority=C)
    sched.add(fresh)
    assert fresh.priority == C
    assert names(sched.schedule()) == ["fresh"]  # admitted within its budget: the breaker closes
    assert br.current(clock.t) == CLOSED


def test_open_breaker_on_low_refuses_with_busy():
    classes = SchedulerPolicy(*[ClassLimits(0, 8, 1) for _ in Priority])
    sched, clock = make(max_seqs=1, classes=classes)
    sched.add(seq("x", priority=L))
    sched.add(seq("y", priority=L))
    clock.t += 0.01
    sched.schedule()  # y has waited past a 0 ms budget
    with pytest.raises(Busy, match="circuit breaker open"):
        sched.add(seq("z", priority=L))


def test_bounded_queue_says_busy():
    sched, _ = make(queue_max_requests=2, queue_max_prompt_tokens=10)
    sched.add(seq("a", n=4))
    sched.add(seq("b", n=4))
    with pytest.raises(Busy, match="2 requests"):
        sched.add(seq("c", n=1))
    sched.schedule()
    with pytest.raises(Busy, match="10 prompt tokens"):
        sched.add(seq("d", n=11))


def test_chunk_budget_and_decodes_first():
    sched, _ = make(budget=8)
    d = seq("decoder", n=3)
    sched.add(d)
    step(sched, sched.schedule())
    long = seq("long", n=30)
    sched.add(long)
    seen = []
    while long.num_output_tokens == 0:
        batch = dict(sched.schedule())
        assert sum(batch.values()) <= 8 and batch[d] == 1
        seen.append(batch[long])
        step(sched, list(batch.items()))
    assert seen == [7, 7, 7, 7, 2]


def test_class_concurrency_limit():
    classes = SchedulerPolicy(ClassLimits(50, 8, 3), ClassLimits(200, 16, 5), ClassLimits(1000, 2, 10),
                              ClassLimits(5000, 8, 20))
    sched, _ = make(classes=classes)
    for i in range(3):
        sched.add(seq(f"n{i}"))
    sched.add(seq("l", priority=L))
    assert names(sched.schedule()) == ["n0", "n1", "l"]


def test_critical_preempts_low_when_slots_are_full_and_low_resumes():
    sched, _ = make(max_seqs=2)
    lows = [seq(f"low{i}", priority=L, arrival=i) for i in range(2)]
    for s in lows:
        sched.add(s)
    step(sched, sched.schedule())
    crit = seq("crit", priority=C, arrival=5)
    sched.add(crit)
    batch = sched.schedule()
    assert "crit" in names(batch) and "low1" not in names(batch)  # the newest low one made room
    assert lows[1].num_preemptions == 1 and lows[1] in sched.waiting and not lows[1].block_table
    sched.finish(crit, "stop")
    assert "low1" in names(sched.schedule())


def test_block_pressure_preempts_least_important():
    sched, _ = make(num_blocks=4, max_seqs=4)
    hi, lo = seq("hi", n=7, priority=H), seq("lo", n=7, priority=L, arrival=1, first=100)
    sched.add(hi)
    sched.add(lo)
    step(sched, sched.schedule())  # 2 blocks each, all 4 used; 8 tokens each after sampling
    step(sched, sched.schedule())  # the 8th token fits; 9 tokens each after sampling
    step(sched, sched.schedule())  # both need a third block now: lo is preempted for hi
    assert lo.status.value == "waiting" and hi.status.value == "running" and len(hi.block_table) == 3


def test_batching_window_holds_an_idle_engine_for_a_fuller_batch():
    sched, clock = make()
    sched.set_window(20, 3)
    sched.add(seq("a"))
    assert sched.schedule() == []  # idle, 1 of 3 waiting, within the 20 ms window
    sched.add(seq("b"))
    clock.t += 0.01
    assert sched.schedule() == []
    sched.add(seq("c"))
    assert names(sched.schedule()) == ["a", "b", "c"]  # min_batch_size reached


def test_batching_window_expires_and_never_delays_critical():
    sched, clock = make()
    sched.set_window(20, 4)
    sched.add(seq("a"))
    clock.t += 0.021
    assert names(sched.schedule()) == ["a"]  # the window ran out
    other, clock2 = make()
    other.set_window(20, 4)
    other.add(seq("n"))
    other.add(seq("c", priority=C))
    assert names(other.schedule()) == ["c", "n"]


def test_full_queue_displaces_the_least_important_waiting_request():
    sched, _ = make(queue_max_requests=2)
    low, normal = seq("low", priority=L), seq("normal", priority=N)
    sched.add(low)
    sched.add(normal)
    crit = seq("crit", priority=C)
    sched.add(crit)  # takes the low request's place
    assert low.finish_reason == "busy" and sched.expired == [low]
    assert [s.request_id for s in sched.waiting] == ["crit", "normal"]
    with pytest.raises(Busy, match="queue is full"):
        sched.add(seq("n2", priority=N))  # nothing less important than normal is waiting


def test_open_breaker_cooldown_runs_from_its_opening_not_from_later_timeouts():
    from o3edge.engine.breaker import Breaker
    br = Breaker(threshold=1, cooldown_s=5.0)
    br.record_timeout(0.1)  # opens
    for t in (1.0, 3.0, 5.0):  # more timeouts while open (requests queued before it opened)
        br.record_timeout(t)
    assert br.current(5.0) == OPEN and br.current(5.2) == HALF_OPEN and br.times_opened == 1
    br.record_timeout(5.3)  # a timeout while half open opens it again, from now
    assert br.current(10.2) == OPEN and br.current(10.3) == HALF_OPEN and br.times_opened == 2


def test_making_room_in_a_full_queue_is_all_or_nothing():
    sched, _ = make(queue_max_requests=10, queue_max_prompt_tokens=12)
    low, normal = seq("low", n=4, priority=L), seq("normal", n=8, priority=N)
    sched.add(low)
    sched.add(normal)
    with pytest.raises(Busy, match="queue is full"):
        sched.add(seq("normal2", n=8, priority=N))  # dropping low alone would not make room
    assert low.finish_reason is None and sched.expired == []
    assert [s.request_id for s in sched.waiting] == ["normal", "low"]
    crit = seq("crit", n=12, priority=C)
    sched.add(crit)  # both must go, and both do
    assert {s.request_id for s in sched.expired} == {"low", "normal"}
    assert [s.request_id for s in sched.waiting] == ["crit"]


def test_a_waiting_critical_request_takes_the_budget_from_a_low_prefill():
    sched, _ = make(budget=64, num_blocks=256)
    low = seq("low", n=400, priority=L)
    sched.add(low)
    step(sched, sched.schedule())  # low prefills with the whole budget
    crit = seq("crit", n=20, priority=C, first=1000)
    sched.add(crit)
    batch = dict(sched.schedule())
    assert batch[crit] == 20 and batch[low] <= 64 // 8  # admitted at once; low gets a small share
    step(sched, list(batch.items()))
    batch = dict(sched.schedule())
    assert batch[crit] == 1 and batch[low] <= 64 // 8  # while critical decodes, low's chunks stay small
    sched.finish(crit, "stop")
    assert dict(sched.schedule())[low] == 64  # alone again: the whole budget


def test_wait_estimate_follows_the_queue():
    """A class's estimated wait is 0 while it would start at once, else the moving average of its recent
    queue waits; `stats` reports it per class (the HTTP door's overflow uses it against deadlines)."""
    sched, clock = make(max_seqs=1)
    assert sched.estimated_wait_ms(N) == 0.0
    first, second, third = seq("a"), seq("b"), seq("c")
    for s in (first, second, third):
        sched.add(s)
    step(sched, sched.schedule())  # a starts at once: a wait of 0
    clock.t += 0.4
    sched.finish(first, "length")
    step(sched, sched.schedule())  # b waited 0.4 s
    assert sched.estimated_wait_ms(N) == pytest.approx(400.0)  # c still waits behind b
    assert sched.stats()["normal"]["est_wait_ms"] == pytest.approx(400.0)
    assert sched.estimated_wait_ms(H) == 0.0  # no queue wait seen in that class yet
    clock.t += 0.8
    sched.finish(second, "length")
    step(sched, sched.schedule())  # c waited 1.2 s: the average moves a quarter of the way
    assert sched.recent_wait_s[N] == pytest.approx(0.4 + 0.25 * (1.2 - 0.4))
    sched.finish(third, "length")
    assert sched.estimated_wait_ms(N) == 0.0  # nothing waits and there is room again
