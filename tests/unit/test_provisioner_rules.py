"""Pure rules of the provisioner: port substitution, zones, backoff, request conversion."""

from __future__ import annotations

import random

import pytest
import tenacity

from replicaplane.common.v1 import spec_pb2
from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import resources_pb2
from services.common import errors
from services.provisioner import convert, launches, model, ports, retries, server, zones
from services.provisioner import settings as provisioner_settings

# ---- ports ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("python3 -m http.server 8080", "python3 -m http.server 41000"),
        ("app --port=8080 --other 18080", "app --port=41000 --other 18080"),
        ("x 80801 8080.5 8080", "x 80801 8080.5 41000"),
        ("echo :8080/health", "echo :41000/health"),
        ("no port here", "no port here"),
        ("8080 and 9090", "41000 and 41001"),
    ],
)
def test_substitute_replaces_whole_port_tokens_only(text: str, expected: str) -> None:
    assert ports.substitute(text, {8080: 41000, 9090: 41001}) == expected


def test_substitute_without_mapping_is_identity() -> None:
    assert ports.substitute("serve 8080", {}) == "serve 8080"


def test_declared_ports_put_serving_port_first_without_duplicates() -> None:
    assert ports.declared([9090, 8080], 8080) == [8080, 9090]
    assert ports.declared([], 0) == []


def test_allocator_never_hands_out_a_held_port_twice() -> None:
    alloc = ports.PortAllocator()
    got = {alloc.allocate() for _ in range(20)}
    assert len(got) == 20
    alloc.release(next(iter(got)))


# ---- zones ------------------------------------------------------------------------------------


def test_zones_parse_sorted_by_price() -> None:
    parsed = zones.parse("b:1.5, a:1.0,c:2")
    assert [z.name for z in parsed] == ["a", "b", "c"]
    assert parsed[0].price_per_hour == 1.0


@pytest.mark.parametrize("text", ["", "a:x", "a:-1", "a:1,a:2", ":1"])
def test_zones_parse_rejects_bad_settings(text: str) -> None:
    with pytest.raises(errors.ValidationError):
        zones.parse(text)


def test_pick_cheapest_accepting_zone_and_refusal_expiry() -> None:
    table = zones.ZoneTable(zones.parse(zones.DEFAULT_ZONES))
    assert table.pick("", now=100).name == "zone-a"
    table.set_refusal("zone-a", 10, now=100)
    assert table.pick("", now=105).name == "zone-b"
    with pytest.raises(zones.NoCapacityError):
        table.pick("zone-a", now=105)
    assert table.pick("zone-a", now=111).name == "zone-a"
    table.set_refusal("zone-a", 10, now=200)
    table.set_refusal("zone-a", 0, now=201)
    assert table.pick("zone-a", now=202).name == "zone-a"


def test_every_zone_refusing_means_no_capacity() -> None:
    table = zones.ZoneTable(zones.parse("a:1,b:2"))
    table.set_refusal("a", 5, now=0)
    table.set_refusal("b", 5, now=0)
    with pytest.raises(zones.NoCapacityError):
        table.pick("", now=1)


def test_unknown_zone() -> None:
    table = zones.ZoneTable(zones.parse("a:1"))
    with pytest.raises(zones.UnknownZoneError):
        table.pick("nope", now=0)
    with pytest.raises(errors.NotFoundError):
        table.set_refusal("nope", 1, now=0)
    with pytest.raises(errors.ValidationError):
        table.set_refusal("a", -1, now=0)


# ---- backoff ----------------------------------------------------------------------------------


def _state(attempt: int) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return state


def test_backoff_defaults_follow_skypilot() -> None:
    wait = retries.wait_jittered_exponential(60, 1.6, 300, rng=random.Random(1))
    assert [wait.base(n) for n in (1, 2, 3, 4, 5)] == pytest.approx([60, 96, 153.6, 245.76, 300])


def test_backoff_jitter_stays_within_40_percent_and_the_cap() -> None:
    wait = retries.wait_jittered_exponential(60, 1.6, 300, rng=random.Random(7))
    for attempt in (1, 2, 3):
        base = wait.base(attempt)
        gaps = [wait(_state(attempt)) for _ in range(200)]
        assert min(gaps) >= base * 0.6 - 1e-9
        assert max(gaps) <= min(base * 1.4, 300) + 1e-9
        assert max(gaps) - min(gaps) > 0
    assert max(wait(_state(9)) for _ in range(100)) <= 300


def test_backoff_without_jitter_is_exact() -> None:
    wait = retries.wait_jittered_exponential(5, 1.6, 25, jitter=0)
    assert [wait(_state(n)) for n in (1, 2, 3, 4)] == pytest.approx([5, 8, 12.8, 20.48])


# ---- request conversion and validation --------------------------------------------------------


def test_launch_request_conversion_records_hardware_and_picks_serving_port() -> None:
    req = pb.LaunchRequest(
        name="svc-3",
        service="svc",
        replica_id=3,
        version=2,
        use_spot=True,
        zone="zone-b",
        spec=spec_pb2.ServiceSpec(
            run="serve 8080",
            setup="pip install x",
            envs={"A": "1"},
            secrets={"TOKEN": "s3cret"},
            resources=spec_pb2.Resources(ports=[8080, 9090], cpus="2+", accelerators="A100:1", cloud="aws"),
            service=spec_pb2.ServiceSection(port=9090),
        ),
    )
    out = convert.launch_request(req)
    assert out.spec.serving_port == 9090
    assert out.spec.ports == (8080, 9090)
    assert out.spec.resources == {"cpus": "2+", "accelerators": "A100:1", "cloud": "aws"}
    assert out.spec.secrets == {"TOKEN": "s3cret"}
    assert out.use_spot and out.zone == "zone-b" and out.version == 2
    assert model.LaunchRequest.from_dict(out.to_dict()) == out


def test_validation_reports_every_bad_field() -> None:
    bad = model.LaunchRequest(name="x", service="Bad_Name", replica_id=0, version=1, spec=model.ReplicaSpec())
    with pytest.raises(errors.ValidationError) as info:
        launches.validate(bad)
    assert {v.field for v in info.value.violations} == {"service", "replica_id", "name"}


def test_enum_names_match_protos() -> None:
    for state in model.ReplicaState:
        assert resources_pb2.ReplicaState.Value(f"REPLICA_STATE_{state.value}")
    for app in model.AppState:
        assert resources_pb2.AppState.Value(f"APP_STATE_{app.value}") is not None
    for t in model.LaunchEventType:
        assert resources_pb2.LaunchEventType.Value(f"LAUNCH_EVENT_TYPE_{t.value}")
    for t in model.TerminateEventType:
        assert resources_pb2.TerminateEventType.Value(f"TERMINATE_EVENT_TYPE_{t.value}")
    for t in model.ReplicaEventType:
        assert resources_pb2.ReplicaEventType.Value(f"REPLICA_EVENT_TYPE_{t.value}")


def test_settings_out_of_range_are_reported_together() -> None:
    settings = provisioner_settings.Settings(max_in_flight=0, launch_attempts=0, kill_grace_s=-1)
    with pytest.raises(errors.ValidationError) as info:
        provisioner_settings.options(settings)
    fields = {v.field for v in info.value.violations}
    assert fields == {"provisioner.max_in_flight", "provisioner.launch_attempts", "provisioner.kill_grace_s"}


def test_settings_come_from_the_environment() -> None:
    env = {"REPLICAPLANE_PROVISIONER_MAX_IN_FLIGHT": "2.5", "REPLICAPLANE_PROVISIONER_ZONES": "x:1,y:2"}
    settings = provisioner_settings.load_settings(environ=env)
    assert settings.max_in_flight == 2.5
    assert [z.name for z in zones.parse(settings.zones)] == ["x", "y"]
    with pytest.raises(errors.ValidationError) as info:
        server.make_backend(provisioner_settings.Settings(backend="nomad"))
    assert [v.field for v in info.value.violations] == ["provisioner.backend"]
