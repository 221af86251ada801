"""Autoscalers, hysteresis, fallback arithmetic, the spot placer and victim order (table-driven)."""

from __future__ import annotations

import pytest

from services.controller.domain import autoscaler as a
from services.controller.domain import placer, scaling
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import ReplicaView as R

RATE = a.Policy(min_replicas=1, max_replicas=5, target_qps=2.0, upscale_delay_s=10, downscale_delay_s=30)
IA = a.Policy(min_replicas=1, max_replicas=10, target_qps_per_accelerator={"A100": 5.0, "H100:1": 10.0})


@pytest.mark.parametrize(
    ("policy", "kind"),
    [
        (a.Policy(), a.FIXED),
        (a.Policy(max_replicas=3, target_qps=1), a.REQUEST_RATE),
        (a.Policy(max_replicas=3, target_qps_per_accelerator={"A100": 1}), a.INSTANCE_AWARE),
        (a.Policy(use_spot=True, base_ondemand=1), a.FALLBACK),
        (a.Policy(use_spot=True, dynamic_fallback=True, target_qps_per_accelerator={"A100": 1}), a.FALLBACK),
        (a.Policy(use_spot=True), a.FIXED),
    ],
)
def test_selection_follows_skypilot_order(policy: a.Policy, kind: str) -> None:
    assert policy.kind == kind


@pytest.mark.parametrize(
    ("policy", "qps", "want"),
    [
        (a.Policy(min_replicas=2, max_replicas=2), 100.0, 2),  # fixed ignores load
        (RATE, 0.0, 1),  # clipped up to min
        (RATE, 2.0, 1),  # exactly one replica's worth
        (RATE, 2.1, 2),  # ceil
        (RATE, 6.0, 3),
        (RATE, 100.0, 5),  # clipped down to max
        (a.Policy(min_replicas=0, max_replicas=3, target_qps=1), 0.0, 0),
        (a.Policy(min_replicas=0, max_replicas=3, target_qps=1), 0.05, 1),
    ],
)
def test_request_rate_candidate(policy: a.Policy, qps: float, want: int) -> None:
    assert a.candidate(policy, qps, []) == want


def test_overprovision_is_added_on_top() -> None:
    policy = a.Policy(min_replicas=1, max_replicas=3, target_qps=1, num_overprovision=2)
    assert a.candidate(policy, 10, []) == 3
    assert policy.final(3) == 5


@pytest.mark.parametrize(
    ("accelerator", "want"),
    [("A100", 5.0), ("H100:1", 10.0), ("H100", 10.0), ("T4", 5.0), ("unknown", 5.0)],
)
def test_instance_aware_lookup_exact_then_base_name_then_smallest(accelerator: str, want: float) -> None:
    assert a.accelerator_qps(IA, accelerator) == want


@pytest.mark.parametrize(
    ("replicas", "qps", "want"),
    [
        ([], 0.0, 1),  # nothing live: min
        ([], 25.0, 3),  # from nothing: ceil(qps / biggest target)
        ([R(1, 1, S.READY, accelerator="A100")], 4.0, 1),  # 5 > 4
        ([R(1, 1, S.READY, accelerator="A100")], 12.0, 2),  # 1 + ceil(7 / 10)
        # READY sorted by target descending: 10 alone exceeds 8.
        ([R(1, 1, S.READY, accelerator="A100"), R(2, 1, S.READY, accelerator="H100")], 8.0, 1),
        ([R(1, 1, S.READY, accelerator="A100"), R(2, 1, S.READY, accelerator="H100")], 12.0, 2),
        # Failed records do not count as capacity or as replicas (fix over SkyPilot).
        ([R(1, 1, S.READY, accelerator="A100"), R(2, 1, S.FAILED, accelerator="H100")], 12.0, 2),
        # STARTING counts as capacity; with none READY the biggest target stands in.
        ([R(1, 1, S.STARTING, accelerator="H100")], 4.0, 1),
        ([R(1, 1, S.READY, accelerator="A100"), R(2, 1, S.STARTING, accelerator="H100")], 7.0, 2),
    ],
)
def test_instance_aware_candidate(replicas: list[R], qps: float, want: int) -> None:
    assert a.candidate(IA, qps, replicas) == want


H = a.Hysteresis


@pytest.mark.parametrize(
    ("state", "wanted", "now", "after", "next_in"),
    [
        (H(2), 2, 100.0, H(2), 20.0),  # equal: hold
        (H(2, 95.0, None), 2, 100.0, H(2), 20.0),  # equal resets the upscale clock
        (H(2, None, 95.0), 2, 100.0, H(2), 20.0),  # ... and the downscale clock
        (H(2), 3, 100.0, H(2, 100.0, None), 10.0),  # higher starts the upscale clock
        (H(2, 95.0, None), 3, 100.0, H(2, 95.0, None), 5.0),  # still higher: the clock runs
        (H(2, 90.0, None), 4, 100.0, H(4), 20.0),  # held for the delay: adopt
        (H(2, 95.0, None), 1, 100.0, H(2, None, 100.0), 20.0),  # lower clears the upscale clock
        (H(2, None, 80.0), 1, 100.0, H(2, None, 80.0), 10.0),  # downscale clock runs
        (H(2, None, 70.0), 1, 100.0, H(1), 20.0),  # held for the downscale delay: adopt
        (H(0), 3, 100.0, H(3), 20.0),  # a target of 0 is left at once
        (H(0), 0, 100.0, H(0), 5.0),  # target 0: decide every 5 s
    ],
)
def test_hysteresis(state: a.Hysteresis, wanted: int, now: float, after: a.Hysteresis, next_in: float) -> None:
    d = a.decide(RATE, state, wanted, now)
    assert d.state == after
    assert d.next_in_s == pytest.approx(next_in)
    assert d.reason


def test_hysteresis_to_zero_waits_for_the_downscale_delay() -> None:
    policy = a.Policy(min_replicas=0, max_replicas=2, target_qps=1, downscale_delay_s=30)
    assert a.decide(policy, H(1), 0, 100.0).state == H(1, None, 100.0)
    d = a.decide(policy, H(1, None, 70.0), 0, 100.0)
    assert d.state == H(0)
    assert d.next_in_s == 5.0
    assert "down from 1 to 0" in d.reason


def test_zero_delay_adopts_at_once() -> None:
    policy = a.Policy(max_replicas=3, target_qps=1, upscale_delay_s=0)
    assert a.decide(policy, H(1), 3, 5.0).state == H(3)


def test_load_window() -> None:
    window: dict[int, int] = {}
    a.add_load(window, [100.2, 100.7, 101.5, 30.0], 3, 102.0, window_s=60)
    assert window == {100: 2, 101: 1, 102: 3}  # 30.0 is older than the window
    assert a.qps(window, 102.0, window_s=60) == pytest.approx(6 / 60)
    assert a.qps(window, 161.0, window_s=60) == pytest.approx(4 / 60)  # bucket 100 aged out
    a.add_load(window, [], 0, 170.0, window_s=60)
    assert window == {}


@pytest.mark.parametrize(
    ("policy", "target", "spot_ready", "want"),
    [
        (a.Policy(use_spot=True, base_ondemand=1), 3, 0, (2, 1)),
        (a.Policy(use_spot=True, base_ondemand=1), 1, 0, (0, 1)),
        (a.Policy(use_spot=True, base_ondemand=5), 2, 0, (0, 2)),  # at most the target
        (a.Policy(use_spot=True, dynamic_fallback=True), 3, 0, (3, 3)),
        (a.Policy(use_spot=True, dynamic_fallback=True), 3, 2, (3, 1)),
        (a.Policy(use_spot=True, dynamic_fallback=True), 3, 3, (3, 0)),
        (a.Policy(use_spot=True, base_ondemand=1, dynamic_fallback=True), 3, 1, (2, 2)),
        # Overprovision adds spot replicas but never on-demand fallback for them.
        (a.Policy(use_spot=True, dynamic_fallback=True, num_overprovision=2), 2, 0, (4, 2)),
    ],
)
def test_fallback_arithmetic(policy: a.Policy, target: int, spot_ready: int, want: tuple[int, int]) -> None:
    assert a.fallback_counts(policy, target=target, spot_ready=spot_ready) == want


def test_fallback_plan_launches_and_removes_each_kind() -> None:
    policy = a.Policy(use_spot=True, dynamic_fallback=True)
    spot_starting = [R(1, 1, S.STARTING, is_spot=True), R(2, 1, S.STARTING, is_spot=True)]
    assert a.fallback_plan(policy, spot_starting, target=2) == a.FallbackPlan(0, 2, ())
    mixed = [R(1, 1, S.READY, is_spot=True), R(2, 1, S.STARTING, is_spot=True), R(3, 1, S.READY), R(4, 1, S.READY)]
    assert a.fallback_plan(policy, mixed, target=2) == a.FallbackPlan(0, 0, (4,))
    spot_ready = [R(1, 1, S.READY, is_spot=True), R(2, 1, S.READY, is_spot=True), R(3, 1, S.READY)]
    assert a.fallback_plan(policy, spot_ready, target=2) == a.FallbackPlan(0, 0, (3,))
    too_many_spot = [R(i, 1, S.READY, is_spot=True) for i in (1, 2, 3)]
    assert a.fallback_plan(policy, too_many_spot, target=2) == a.FallbackPlan(0, 0, (3,))


def test_scaling_plan_with_fallback() -> None:
    policy = a.Policy(use_spot=True, base_ondemand=1)
    assert scaling.plan([], target=3, latest_version=1, fallback=(policy, 3)) == scaling.ScalePlan(
        launch=2, launch_ondemand=1
    )
    assert scaling.plan([], target=3, latest_version=1, fallback=(policy, 3), stopped=True) == scaling.ScalePlan()


@pytest.mark.parametrize(
    ("replicas", "count", "want"),
    [
        ([R(1, 1, S.READY), R(2, 1, S.PENDING), R(3, 1, S.STARTING)], 2, [2, 3]),
        ([R(1, 1, S.READY), R(2, 1, S.NOT_READY), R(3, 1, S.PROVISIONING)], 2, [3, 2]),
        ([R(1, 2, S.READY), R(2, 1, S.READY)], 1, [2]),  # older version first
        ([R(1, 1, S.READY), R(2, 1, S.READY), R(3, 1, S.READY)], 2, [3, 2]),  # highest id first
        ([R(1, 1, S.READY), R(2, 1, S.FAILED)], 2, [1]),  # terminal records are never victims
    ],
)
def test_victim_order(replicas: list[R], count: int, want: list[int]) -> None:
    from services.controller.domain import status

    assert [r.replica_id for r in status.scale_down_victims(replicas, count)] == want


ZONES = [("zone-a", 1.0), ("zone-b", 1.2), ("zone-c", 1.5)]


@pytest.mark.parametrize(
    ("marks", "used", "want"),
    [
        ({}, set(), "zone-a"),  # cheapest
        ({}, {"zone-a"}, "zone-b"),  # not used by another spot replica
        ({}, {"zone-a", "zone-b", "zone-c"}, "zone-a"),  # all used: cheapest ACTIVE
        ({"zone-a": placer.PREEMPTIVE}, set(), "zone-b"),
        ({"zone-a": placer.PREEMPTIVE}, {"zone-b"}, "zone-c"),
    ],
)
def test_placer_select(marks: dict[str, str], used: set[str], want: str) -> None:
    assert placer.select(ZONES, marks, used) == want


def test_placer_select_without_zones() -> None:
    assert placer.select([], {}, set()) == ""


def test_placer_marks_and_resets_below_two_active() -> None:
    marks = placer.mark(ZONES, {}, "zone-a", preempted=True)
    assert marks == {"zone-a": placer.PREEMPTIVE, "zone-b": placer.ACTIVE, "zone-c": placer.ACTIVE}
    assert placer.mark(ZONES, marks, "zone-a", preempted=False)["zone-a"] == placer.ACTIVE
    # A second preemption would leave one ACTIVE zone: every zone is ACTIVE again.
    assert set(placer.mark(ZONES, marks, "zone-b", preempted=True).values()) == {placer.ACTIVE}
    assert placer.mark(ZONES, marks, "nowhere", preempted=True) == marks


REGIONAL = [("us-west-2a", 0.9), ("us-east-1a", 1.0), ("us-east-1b", 1.1), ("us-east-1c", 1.3)]


@pytest.mark.parametrize(
    ("places", "want"),
    [
        ([], ["us-west-2a", "us-east-1a", "us-east-1b", "us-east-1c"]),  # no resources named
        ([("", "")], ["us-west-2a", "us-east-1a", "us-east-1b", "us-east-1c"]),
        ([("us-east-1b", "")], ["us-east-1b"]),
        ([("", "us-east-1")], ["us-east-1a", "us-east-1b", "us-east-1c"]),
        ([("us-east-1b", "us-east-1")], ["us-east-1b"]),
        ([("us-east-1b", "us-west-2")], []),  # the zone is not in the region
        ([("us-east-1c", ""), ("", "us-west-2")], ["us-west-2a", "us-east-1c"]),  # any_of: either
        ([("us-east-1c", ""), ("", "")], ["us-west-2a", "us-east-1a", "us-east-1b", "us-east-1c"]),  # one open
        ([("nowhere", "")], []),
    ],
)
def test_placer_allowed_zones_follow_the_spec(places: list[placer.Place], want: list[str]) -> None:
    assert [name for name, _ in placer.allowed(REGIONAL, places)] == want


def test_placer_spot_stays_in_the_spec_region() -> None:
    # The cheapest zone overall (us-west-2a) is outside the region; used zones are skipped.
    zones = placer.allowed(REGIONAL, [("", "us-east-1")])
    assert placer.select(zones, {}, set()) == "us-east-1a"
    assert placer.select(zones, {}, {"us-east-1a"}) == "us-east-1b"
    assert placer.select(zones, {"us-east-1b": placer.PREEMPTIVE}, {"us-east-1a"}) == "us-east-1c"
    # One named zone: always it, and marking it never leaves it PREEMPTIVE (fewer than 2 ACTIVE).
    one = placer.allowed(REGIONAL, [("us-east-1b", "")])
    assert placer.select(one, {}, {"us-east-1b"}) == "us-east-1b"
    assert placer.mark(one, {}, "us-east-1b", preempted=True) == {"us-east-1b": placer.ACTIVE}


@pytest.mark.parametrize(
    ("zones", "places", "want"),
    [
        (REGIONAL, [("", "")], ""),  # unconstrained: the backend picks
        (REGIONAL, [], ""),
        (REGIONAL, [("us-east-1b", "")], "us-east-1b"),
        (REGIONAL, [("", "us-east-1")], "us-east-1a"),  # cheapest in the region, not us-west-2a
        (REGIONAL, [("us-east-1c", ""), ("us-east-1b", "")], "us-east-1b"),  # cheapest alternative
        ([], [("us-east-1b", "")], "us-east-1b"),  # zones unknown: the named zone
        ([], [("", "us-east-1")], ""),  # zones unknown, region only: the backend picks
        (REGIONAL, [("nowhere", "")], "nowhere"),  # unknown zone: the backend refuses it
    ],
)
def test_placer_fixed_zone_for_ondemand_launches(
    zones: list[tuple[str, float]], places: list[placer.Place], want: str
) -> None:
    assert placer.fixed_zone(zones, places) == want


def test_placer_problems_name_the_field_of_each_unknown_place() -> None:
    places = [
        ("resources.any_of[0]", ("us-east-1b", "")),  # fine
        ("resources.any_of[1]", ("zone-x", "")),
        ("resources.any_of[2]", ("", "eu-west-1")),
        ("resources.any_of[3]", ("us-east-1b", "us-west-2")),
        ("resources.any_of[4]", ("", "us-east-1")),  # fine
    ]
    got = placer.problems(REGIONAL, places)
    assert [field for field, _ in got] == [
        "resources.any_of[1].zone",
        "resources.any_of[2].region",
        "resources.any_of[3].region",
    ]
    assert "zone-x" in got[0][1] and "us-west-2a" in got[0][1]
    # A spec made for a cloud says how to run it on the local backend's simulated zones.
    assert "REPLICAPLANE_PROVISIONER_ZONES=zone-x:1.00" in got[0][1]
    assert "REPLICAPLANE_PROVISIONER_ZONES=eu-west-1-a:1.00" in got[1][1]
    assert placer.allowed([("eu-west-1-a", 1.0)], [("", "eu-west-1")])  # and that zone would do
    assert placer.problems([], places) == []  # zones unknown: nothing to check against


def test_places_of_a_spec_are_its_resources_alternatives() -> None:
    from services.common import spec
    from services.controller import convert

    top = "name: s\nservice:\n  replicas: 1\nresources:\n  ports: 8080\n  region: us-east-1\nrun: x\n"
    assert convert.places_of(spec.parse(top)) == [("resources", ("", "us-east-1"))]
    any_of = top.replace("  region: us-east-1\n", "  region: us-east-1\n  any_of:\n    - zone: us-east-1b\n    - {}\n")
    # Entries take the top level's region as their default.
    assert convert.places_of(spec.parse(any_of)) == [
        ("resources.any_of[0]", ("us-east-1b", "us-east-1")),
        ("resources.any_of[1]", ("", "us-east-1")),
    ]
    k8s = top.replace("  region: us-east-1\n", "  infra: k8s/my-context\n")
    assert convert.places_of(spec.parse(k8s)) == [("resources", ("", ""))]  # a context, not a region


@pytest.mark.parametrize(
    ("policy", "most"),
    [
        (a.Policy(min_replicas=2, max_replicas=2), 2),
        (a.Policy(min_replicas=0, max_replicas=0), 0),
        (a.Policy(min_replicas=1, max_replicas=5, target_qps=1, num_overprovision=2), 7),
        (a.Policy(min_replicas=4, max_replicas=2), 4),  # max below min: min wins, as clip()
        (a.Policy(min_replicas=3, max_replicas=3, use_spot=True, base_ondemand=1), 3),  # 2 spot + 1 on-demand
        (a.Policy(min_replicas=3, max_replicas=3, use_spot=True), 3),  # spot without fallback
        # Dynamic fallback: every spot replica not READY may have an on-demand stand-in.
        (a.Policy(min_replicas=1, max_replicas=4, target_qps=1, use_spot=True, dynamic_fallback=True), 8),
        (
            a.Policy(
                min_replicas=1,
                max_replicas=4,
                target_qps=1,
                num_overprovision=1,
                use_spot=True,
                base_ondemand=1,
                dynamic_fallback=True,
            ),
            8,  # 4 spot (5 - 1 base) + on-demand at most the target (4)
        ),
    ],
)
def test_most_replicas_is_the_largest_count_a_policy_can_run(policy: a.Policy, most: int) -> None:
    assert a.most_replicas(policy) == most
    # No target and no READY count makes the autoscaler ask for more than that.
    for target in range(policy.min_replicas, max(policy.max_replicas, policy.min_replicas) + 1):
        if policy.kind == a.FALLBACK:
            spot, ondemand = a.fallback_counts(policy, target=target, spot_ready=0)
            assert spot + ondemand <= most
        else:
            assert policy.final(target) <= most


def test_the_expected_accelerator_is_the_first_alternatives_first_choice() -> None:
    from services.common import spec
    from services.controller import convert

    top = "name: s\nservice:\n  replicas: 1\nresources:\n  ports: 8080\n{}run: x\n"
    assert convert.accelerator_of(spec.parse(top.format(""))) == ""
    assert convert.accelerator_of(spec.parse(top.format("  accelerators: [L4, A100:2]\n"))) == "L4"
    any_of = "  any_of:\n    - accelerators: H100:2\n    - accelerators: A100\n"
    assert convert.accelerator_of(spec.parse(top.format(any_of))) == "H100"
    # Until the provisioner says which alternative it placed (`accelerator_name` of its report).
    assert convert.accelerator_name("A100:2") == "A100"
