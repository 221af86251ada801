"""Load reports in the controller's domain: exactly once per balancer and sequence, and arrival
times from ages on the controller's clock. Table-driven, no server."""

from __future__ import annotations

import pytest

from services.controller.domain import load

NOW = 1_000_000.0
WINDOW_S = 60.0


@pytest.mark.parametrize(
    ("ledger", "balancer_id", "sequence", "expected"),
    [
        ({}, "", 0, False),  # no identity: applied every time it arrives
        ({"a": 5}, "", 0, False),
        ({}, "a", 1, False),  # first report from a balancer
        ({"a": 5}, "a", 6, False),
        ({"a": 5}, "a", 9, False),  # sequences may skip
        ({"a": 5}, "a", 5, True),  # a resend
        ({"a": 5}, "a", 4, True),  # a late copy of an older report
        ({"a": 5}, "b", 1, False),  # another balancer has its own sequence
    ],
)
def test_already_applied(ledger: dict[str, int], balancer_id: str, sequence: int, expected: bool) -> None:
    assert load.already_applied(ledger, balancer_id, sequence) is expected


@pytest.mark.parametrize(
    ("ledger", "balancer_id", "sequence", "capacity", "expected"),
    [
        ({}, "a", 1, 3, [("a", 1)]),
        ({"a": 1, "b": 4}, "a", 2, 3, [("b", 4), ("a", 2)]),  # most recently seen last
        ({"a": 1, "b": 4, "c": 2}, "d", 1, 3, [("b", 4), ("c", 2), ("d", 1)]),  # the oldest leaves
        ({"a": 1, "b": 4, "c": 2}, "a", 2, 3, [("b", 4), ("c", 2), ("a", 2)]),
    ],
)
def test_remember_keeps_the_most_recent_balancers(
    ledger: dict[str, int], balancer_id: str, sequence: int, capacity: int, expected: list[tuple[str, int]]
) -> None:
    assert list(load.remember(ledger, balancer_id, sequence, capacity=capacity).items()) == expected


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        (load.Report(), []),
        (load.Report(ages=(0.0, 1.5, 59.0)), [NOW, NOW - 1.5, NOW - 59.0]),
        # Legacy times: on the sender's clock; one ahead of ours is taken as arriving now.
        (load.Report(times=(NOW - 3.0, NOW + 0.5, NOW + 90.0)), [NOW - 3.0, NOW, NOW]),
        (load.Report(ages=(2.0,), times=(NOW - 1.0,)), [NOW - 2.0, NOW - 1.0]),
    ],
)
def test_arrivals_are_on_the_controllers_clock(report: load.Report, expected: list[float]) -> None:
    assert load.arrivals(report, NOW) == expected


@pytest.mark.parametrize(
    ("window", "ledger", "report", "counted", "duplicate", "window_after", "ledger_after"),
    [
        # Counted into per-second buckets: ages, legacy times and a count at arrival.
        ({}, {}, load.Report(ages=(0.2, 1.0), count=2), 4, False, {int(NOW): 2, int(NOW) - 1: 2}, {}),
        # Older than the window: not counted, the rest is.
        ({}, {}, load.Report(ages=(5.0, 3600.0)), 1, False, {int(NOW) - 5: 1}, {}),
        ({}, {}, load.Report(times=(NOW - 3600.0, NOW + 3600.0)), 1, False, {int(NOW): 1}, {}),
        # With an identity, the ledger remembers it.
        ({}, {}, load.Report(balancer_id="a", sequence=1, count=1), 1, False, {int(NOW): 1}, {"a": 1}),
        # A resend of an applied report changes nothing.
        (
            {int(NOW): 1},
            {"a": 1},
            load.Report(balancer_id="a", sequence=1, count=1),
            0,
            True,
            {int(NOW): 1},
            {"a": 1},
        ),
        # Buckets that left the window are dropped.
        ({int(NOW) - 120: 7}, {}, load.Report(count=1), 1, False, {int(NOW): 1}, {}),
    ],
)
def test_apply(
    window: dict[int, int],
    ledger: dict[str, int],
    report: load.Report,
    counted: int,
    duplicate: bool,
    window_after: dict[int, int],
    ledger_after: dict[str, int],
) -> None:
    before = (dict(window), dict(ledger))
    out = load.apply(window, ledger, report, NOW, window_s=WINDOW_S)
    assert (out.counted, out.already_applied) == (counted, duplicate)
    assert (out.window, out.ledger) == (window_after, ledger_after)
    assert (window, ledger) == before  # the inputs are not changed


def test_a_resend_after_newer_reports_is_still_counted_once() -> None:
    window: dict[int, int] = {}
    ledger: dict[str, int] = {}
    total = 0
    for report in [
        load.Report(balancer_id="a", sequence=1, ages=(0.1,)),
        load.Report(balancer_id="a", sequence=1, ages=(0.6,)),  # resent 0.5 s later: same report
        load.Report(balancer_id="a", sequence=2, ages=(0.1, 0.2)),
        load.Report(balancer_id="a", sequence=1, ages=(0.1,)),  # the first attempt, delivered late
        load.Report(balancer_id="b", sequence=1, ages=(0.1,)),  # a restarted balancer: a new id
    ]:
        out = load.apply(window, ledger, report, NOW, window_s=WINDOW_S)
        window, ledger, total = out.window, out.ledger, total + out.counted
    assert total == 4
    assert sum(window.values()) == 4
