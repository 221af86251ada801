"""The controller's view of a service's balancers (URL with a TTL, drains confirmed idle) and the
fleet's port assignment (issue 20 items 7-9)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.common import errors
from services.controller import balancers as b
from services.loadbalancer import fleet, link
from services.loadbalancer import settings as lb_settings


def report(bid: str = "a", url: str = "http://127.0.0.1:30001", version: int = 5, **in_flight: int) -> b.Report:
    counts = {int(k[1:]): v for k, v in in_flight.items()}
    return b.Report(balancer_id=bid, url=url, endpoints_version=version, in_flight=counts)


def test_a_url_is_shown_while_its_balancer_reports_and_expires_after_the_ttl() -> None:
    t = b.Table(ttl_s=15)
    assert t.url() == "" and t.next_expiry() is None
    t.report(report(), now=100)
    assert t.url() == "http://127.0.0.1:30001"
    assert t.next_expiry() == 115
    t.expire(now=114)
    assert t.url() == "http://127.0.0.1:30001"
    t.report(b.Report(balancer_id="a"), now=110)  # a report without URL keeps the one it had
    t.expire(now=124)
    assert t.url() == "http://127.0.0.1:30001"
    t.expire(now=125)
    assert t.url() == ""


def test_the_first_live_balancer_keeps_the_url_and_a_closing_one_goes_at_once() -> None:
    t = b.Table(ttl_s=15)
    t.report(report("a", "http://a:1"), now=1)
    t.report(report("b", "http://b:2"), now=2)
    t.report(report("b", "http://b:2"), now=3)
    assert t.url() == "http://a:1"
    t.report(b.Report(balancer_id="a", closing=True), now=4)
    assert t.url() == "http://b:2"


def test_a_sender_of_counts_only_is_no_balancer() -> None:
    t = b.Table(ttl_s=15)
    t.report(b.Report(balancer_id="script"), now=1)
    assert t.next_expiry() is None


def test_a_drain_ends_once_every_live_balancer_reports_nothing_in_flight_with_a_newer_endpoint_set() -> None:
    t = b.Table(ttl_s=15)
    t.report(report("a", version=5, r2=1), now=1)
    t.report(report("b", "http://b:1", version=5), now=1)
    t.draining(2, now=2, after_version=5)
    t.draining(3, now=2, after_version=None)  # never routed: any later report counts
    assert t.drained() == []  # no report since the drain started
    t.report(report("a", version=5), now=3)  # idle, but still routing with the old set
    t.report(report("b", "http://b:1", version=6), now=3)
    assert t.drained() == [3]
    t.report(report("a", version=6, r2=1), now=4)  # one request still running
    assert t.drained() == []
    t.report(report("a", version=6), now=5)
    assert t.drained() == [2]
    assert t.drained() == []  # told once


def test_no_drain_ends_early_without_balancers_or_with_one_that_does_not_report_in_flight() -> None:
    t = b.Table(ttl_s=15)
    t.draining(1, now=0, after_version=None)
    assert t.drained() == []
    t.report(report("a", version=1), now=1)
    t.report(b.Report(balancer_id="old", url="http://old:1"), now=1)  # no in-flight counts
    assert t.drained() == []
    t.report(b.Report(balancer_id="old", closing=True), now=2)
    assert t.drained() == [1]


def test_reports_carry_in_flight_counts_and_the_endpoint_version() -> None:
    msg = link.request_of(
        link.Report(sequence=1, times=[], count=0),
        service="s",
        balancer_id="x",
        url="http://h:1",
        now=0,
        in_flight={2: 3, 4: 0},
        endpoints_version=7,
    )
    assert [(e.replica_id, e.requests) for e in msg.in_flight] == [(2, 3)]
    assert msg.in_flight_reported and msg.endpoints_version == 7 and not msg.closing
    assert not link.request_of(link.Report(1, [], 0), service="s", balancer_id="x", url="", now=0).in_flight_reported


def test_fleet_ports_count_up_stay_with_their_service_and_survive_a_restart(tmp_path) -> None:
    path = str(tmp_path / "lb" / "ports.json")
    ports = fleet.Ports(30001, 30003, path)
    assert next(ports.candidates("a", in_use=set())) == 30001
    ports.assign("a", 30001)
    assert next(ports.candidates("b", in_use={30001})) == 30002
    ports.assign("b", 30002)
    again = fleet.Ports(30001, 30003, path)
    assert json.loads((tmp_path / "lb" / "ports.json").read_text()) == {"a": 30001, "b": 30002}
    # b restarts first: it takes its own port, not the first free one.
    assert next(again.candidates("b", in_use=set())) == 30002
    # A new service takes a port no other service had, then those of services not served now.
    assert list(again.candidates("c", in_use={30002})) == [30003, 30001]
    # The controller's URL (another fleet process's, or before a restart) is the next best.
    assert next(fleet.Ports(30001, 30003).candidates("c", in_use=set(), hint=30003)) == 30003
    assert list(fleet.Ports(0, 0).candidates("c", in_use=set())) == [0]


def test_a_bad_port_file_is_ignored(tmp_path) -> None:
    path = tmp_path / "ports.json"
    path.write_text("[1, 2")
    assert fleet.Ports(30001, 30002, str(path)).assigned == {}
    path.write_text(json.dumps({"a": 1, "b": 30002}))
    assert fleet.Ports(30001, 30002, str(path)).assigned == {"b": 30002}


def test_a_fleet_on_port_0_counts_up_from_the_port_it_picked_and_keeps_earlier_ports(tmp_path) -> None:
    path = str(tmp_path / "ports.json")
    settings = lb_settings.load_settings(environ={}, fleet=True, http_addr="127.0.0.1:0", fleet_ports_file=path)
    ports = lb_settings.fleet_ports(settings, 41000)
    assert (ports.first, ports.last) == (41000, 41999)
    ports.assign("a", 41000)
    # The next start picks another first port: "a" keeps the port it had, a new service counts up.
    again = lb_settings.fleet_ports(settings, 45000)
    assert (again.first, again.last) == (45000, 45999)
    assert next(again.candidates("a", in_use=set())) == 41000
    assert next(again.candidates("b", in_use=set())) == 45000
    # A fixed first port keeps its range and its bound.
    fixed = lb_settings.load_settings(environ={}, fleet=True, http_addr="127.0.0.1:30001", fleet_port_max=30020)
    assert (lb_settings.fleet_ports(fixed, 30001).first, lb_settings.fleet_ports(fixed, 30001).last) == (30001, 30020)
    assert lb_settings.fleet_ports(dataclasses.replace(fixed, fleet_port_max=0), 30001).last == 31000


def test_a_fleet_port_max_with_a_picked_first_port_is_refused() -> None:
    with pytest.raises(errors.ValidationError) as err:
        lb_settings.load_settings(environ={}, fleet=True, http_addr="127.0.0.1:0", fleet_port_max=30020)
    assert [v.field for v in err.value.violations] == ["loadbalancer.fleet_port_max"]
    with pytest.raises(errors.ValidationError) as err:
        lb_settings.load_settings(environ={}, fleet=True, http_addr="127.0.0.1:30010", fleet_port_max=30001)
    assert [v.field for v in err.value.violations] == ["loadbalancer.fleet_port_max"]


def test_port_of_reads_only_urls_of_the_fleets_host() -> None:
    assert fleet.port_of("http://127.0.0.1:30007", "127.0.0.1") == 30007
    assert fleet.port_of("http://elsewhere:30007", "127.0.0.1") == 0
    assert fleet.port_of("", "127.0.0.1") == 0
