"""Pool rules: job states, queue order, dispatch, recovery and cancel; the queue-length target and
which workers a pool removes (table-driven)."""

from __future__ import annotations

import pytest

from services.controller.domain import autoscaler as a
from services.controller.domain import jobs as j
from services.controller.domain import pool_scaling as ps
from services.controller.domain.jobs import JobState as J
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import ReplicaView as R

# ---- jobs -------------------------------------------------------------------------------------


def test_the_queue_is_fifo_and_a_recovered_job_keeps_its_place() -> None:
    jobs = [
        j.Job(3),
        j.Job(1, J.SUCCEEDED),
        j.Job(2, J.PENDING, recoveries=1),
        j.Job(4, J.RUNNING, worker=1),
        j.Job(5, J.CANCELLED),
    ]
    assert [x.job_id for x in j.queue(jobs)] == [2, 3]


@pytest.mark.parametrize(
    ("jobs", "workers", "want"),
    [
        # no worker READY: nothing starts
        ([j.Job(1)], [j.Worker(1, ready=False)], []),
        # one job per free READY worker, oldest job first, lowest worker id first
        ([j.Job(2), j.Job(1), j.Job(3)], [j.Worker(5, True), j.Worker(2, True)], [(1, 2), (2, 5)]),
        # a busy worker takes nothing
        ([j.Job(1, J.RUNNING, worker=1), j.Job(2)], [j.Worker(1, True), j.Worker(2, True)], [(2, 2)]),
        ([j.Job(1, J.RUNNING, worker=1), j.Job(2)], [j.Worker(1, True)], []),
        # a finished job frees its worker
        ([j.Job(1, J.SUCCEEDED, worker=1), j.Job(2)], [j.Worker(1, True)], [(2, 1)]),
        # more workers than jobs
        ([j.Job(7)], [j.Worker(1, True), j.Worker(2, True)], [(7, 1)]),
        ([], [j.Worker(1, True)], []),
    ],
)
def test_assign_pairs_oldest_jobs_with_free_ready_workers(
    jobs: list[j.Job], workers: list[j.Worker], want: list[tuple[int, int]]
) -> None:
    assert j.assign(jobs, workers) == want


def test_dispatch_counts_attempts() -> None:
    job = j.dispatched(j.Job(1), 3)
    assert (job.state, job.worker, job.attempt) == (J.RUNNING, 3, 1)
    assert j.dispatched(j.worker_lost(job, "died"), 4).attempt == 2


@pytest.mark.parametrize(
    ("code", "state", "message"),
    [(0, J.SUCCEEDED, ""), (1, J.FAILED, "exited with code 1"), (137, J.FAILED, "exited with code 137")],
)
def test_an_exit_code_decides_success(code: int, state: J, message: str) -> None:
    job = j.exited(j.Job(1, J.RUNNING, worker=1), code)
    assert (job.state, job.exit_code, job.message) == (state, code, message)


@pytest.mark.parametrize(
    ("job", "state", "recoveries"),
    [
        (j.Job(1, J.RUNNING, worker=1), J.PENDING, 1),
        (j.Job(1, J.RUNNING, worker=1, recoveries=2), J.PENDING, 3),
        (j.Job(1, J.RUNNING, worker=1, recoveries=3), J.FAILED, 3),  # capped
        (j.Job(1, J.RUNNING, worker=1, cancel_requested=True), J.CANCELLED, 0),
        (j.Job(1, J.SUCCEEDED, worker=1), J.SUCCEEDED, 0),  # finished jobs never move
    ],
)
def test_a_lost_worker_requeues_its_job_until_the_cap(job: j.Job, state: J, recoveries: int) -> None:
    after = j.worker_lost(job, "worker died", max_recoveries=3)
    assert (after.state, after.recoveries) == (state, recoveries)
    if state is J.PENDING:
        assert after.message == "queued again: worker died"
    if state is J.FAILED:
        assert "gave up after 3 recoveries" in after.message


@pytest.mark.parametrize(
    ("job", "state", "tell_worker"),
    [
        (j.Job(1), J.CANCELLED, False),
        (j.Job(1, J.RUNNING, worker=2), J.RUNNING, True),
        (j.Job(1, J.SUCCEEDED), J.SUCCEEDED, False),
        (j.Job(1, J.FAILED, exit_code=2), J.FAILED, False),
        (j.Job(1, J.CANCELLED), J.CANCELLED, False),
    ],
)
def test_cancel(job: j.Job, state: J, tell_worker: bool) -> None:
    after, tell = j.cancel(job)
    assert (after.state, tell) == (state, tell_worker)
    if tell:
        assert after.cancel_requested
        assert j.cancelled(after).state is J.CANCELLED


def test_a_refused_job_goes_back_to_the_queue_without_counting_a_recovery() -> None:
    job = j.refused(j.Job(1, J.RUNNING, worker=2, attempt=1), "worker 2 could not take it")
    assert (job.state, job.recoveries, job.attempt) == (J.PENDING, 0, 1)
    assert j.refused(j.Job(1, J.RUNNING, worker=2, cancel_requested=True), "x").state is J.CANCELLED


def test_terminal_jobs_never_change() -> None:
    for state in (J.SUCCEEDED, J.FAILED, J.CANCELLED):
        job = j.Job(1, state, exit_code=3)
        assert j.exited(job, 0) == job
        assert j.cancelled(job) == job
        assert j.could_not_run(job, "x") == job
        assert j.worker_lost(job, "x") == job
        assert j.refused(job, "x") == job


def test_busy_workers() -> None:
    jobs = [j.Job(1, J.RUNNING, worker=2), j.Job(2, J.SUCCEEDED, worker=3), j.Job(3)]
    assert j.busy_workers(jobs) == {2}


# ---- the queue-length target ------------------------------------------------------------------

RANGE = ps.PoolPolicy(min_workers=0, max_workers=3, queue_length_threshold=1, upscale_delay_s=0, downscale_delay_s=0)


@pytest.mark.parametrize(
    ("policy", "target", "queued", "want"),
    [
        (RANGE, 0, 0, 0),
        (RANGE, 0, 1, 1),  # never 0 with jobs queued
        (RANGE, 0, 6, 1),  # one step at a time
        (RANGE, 1, 6, 2),
        (RANGE, 3, 6, 3),  # clipped to max
        (RANGE, 2, 1, 2),  # as many as the threshold: hold
        (RANGE, 3, 0, 0),  # an empty queue asks for zero
        (ps.PoolPolicy(min_workers=1, max_workers=5, queue_length_threshold=4), 3, 2, 2),  # fewer: one less
        (ps.PoolPolicy(min_workers=1, max_workers=5, queue_length_threshold=4), 1, 2, 1),  # min holds
        (ps.PoolPolicy(min_workers=2, max_workers=2, queue_length_threshold=0), 2, 50, 2),  # fixed size
        (ps.PoolPolicy(min_workers=2, max_workers=2, queue_length_threshold=0), 2, 0, 2),
    ],
)
def test_queue_candidate_follows_skypilot(policy: ps.PoolPolicy, target: int, queued: int, want: int) -> None:
    assert ps.candidate(policy, target, queued) == want


def test_a_pool_at_zero_grows_at_once_and_keeps_deciding_while_the_queue_asks_for_more() -> None:
    policy = ps.PoolPolicy(min_workers=0, max_workers=3, upscale_delay_s=0, downscale_delay_s=60)
    state = a.Hysteresis(0)
    targets = []
    for _ in range(5):
        d = ps.decide(policy, state, 6, 100.0)
        state = d.state
        targets.append(state.target)
        if state.target < 3:
            assert d.next_in_s == 0  # the next step is due at once
    assert targets == [1, 2, 3, 3, 3]


def test_the_upscale_delay_holds_a_higher_target() -> None:
    policy = ps.PoolPolicy(min_workers=0, max_workers=3, upscale_delay_s=30, downscale_delay_s=60)
    d = ps.decide(policy, a.Hysteresis(1), 5, 100.0)
    assert d.state.target == 1 and d.state.upscale_since == 100.0
    assert ps.decide(policy, d.state, 5, 120.0).state.target == 1
    assert ps.decide(policy, d.state, 5, 130.0).state.target == 2


def test_an_empty_queue_scales_to_zero_after_the_downscale_delay() -> None:
    policy = ps.PoolPolicy(min_workers=0, max_workers=3, upscale_delay_s=0, downscale_delay_s=60)
    d = ps.decide(policy, a.Hysteresis(2), 0, 100.0)
    assert d.state.target == 2 and d.state.downscale_since == 100.0
    assert d.next_in_s == pytest.approx(20.0)
    assert ps.decide(policy, d.state, 0, 159.0).state.target == 2
    assert ps.decide(policy, d.state, 0, 160.0).state.target == 0


# ---- which workers go -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "busy", "count", "want"),
    [
        # idle READY first (highest id first), then not READY in status order; never busy
        ([R(1, 1, S.READY), R(2, 1, S.READY), R(3, 1, S.STARTING)], {1}, 2, [2, 3]),
        ([R(1, 1, S.READY), R(2, 1, S.PENDING), R(3, 1, S.STARTING)], set(), 3, [1, 2, 3]),
        ([R(1, 1, S.READY), R(2, 1, S.READY)], {1, 2}, 2, []),
        ([R(1, 1, S.READY), R(2, 2, S.READY)], set(), 1, [1]),  # older version first
        ([R(1, 1, S.READY), R(2, 1, S.READY), R(3, 1, S.READY)], set(), 2, [3, 2]),
        ([R(1, 1, S.READY), R(2, 1, S.SHUTTING_DOWN)], set(), 2, [1]),  # terminal ones are not counted
        ([R(1, 1, S.READY)], set(), 0, []),
    ],
)
def test_victims_are_never_busy(workers: list[R], busy: set[int], count: int, want: list[int]) -> None:
    assert ps.victims(workers, busy, count) == want


@pytest.mark.parametrize(
    ("workers", "busy", "target", "stopped", "want"),
    [
        ([], set(), 3, False, ps.Plan(launch=3)),
        ([R(1, 1, S.READY)], set(), 3, True, ps.Plan()),  # a stopped version launches nothing
        # target 0: idle workers go, busy ones stay
        ([R(1, 1, S.READY), R(2, 1, S.READY), R(3, 1, S.STARTING)], {1}, 0, False, ps.Plan(teardown=(2, 3))),
        # failed records do not count toward the size
        ([R(1, 1, S.FAILED), R(2, 1, S.READY)], set(), 2, False, ps.Plan(launch=1)),
        # an older version: idle workers go at once, busy ones when their job ends
        ([R(1, 1, S.READY), R(2, 1, S.READY), R(3, 2, S.READY)], {1}, 2, False, ps.Plan(launch=1, teardown=(2,))),
    ],
)
def test_plan(workers: list[R], busy: set[int], target: int, stopped: bool, want: ps.Plan) -> None:
    assert (
        ps.plan(
            workers,
            busy,
            target=target,
            latest_version=2 if any(w.version == 2 for w in workers) else 1,
            stopped=stopped,
        )
        == want
    )


# ---- a pool spec in the core's terms ----------------------------------------------------------


def test_a_pool_spec_gives_the_core_its_sizes_delays_and_failure_window() -> None:
    from services.common import spec
    from services.controller import convert, facts

    parsed = spec.parse(
        "name: b\npool: {min_workers: 1, max_workers: 4, upscale_delay_seconds: 7, downscale_delay_seconds: 9}\n"
        "setup: echo ready\n",
        replica_cap=100,
    )
    policy = convert.policy_of(parsed)
    assert (policy.min_replicas, policy.max_replicas, policy.upscale_delay_s, policy.downscale_delay_s) == (1, 4, 7, 9)
    assert a.most_replicas(policy) == 4  # what the replica budget holds for it
    assert facts.windows_of(parsed, parsed).failure_threshold_s == 10.0
