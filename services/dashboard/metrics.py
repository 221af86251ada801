"""The web dashboard's own metrics: open pages, the controller streams behind them, events sent,
and pages turned away.

Labels are bounded: an event kind, a connection outcome or a link state, all fixed here. Never a
token (not even its hash), a page's address or a service name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

EVENT_KINDS = ("snapshot", "change", "connection", "denied", "closing")
OUTCOMES = ("accepted", "bad_token", "denied", "full")
BRIDGE_STATES = ("starting", "live", "unreachable", "denied")


class _Live(Collector):
    """Pages, bridges and streams read at scrape time from the bridges (no bookkeeping)."""

    def __init__(
        self,
        pages: Callable[[], int],
        bridges: Callable[[], Mapping[str, int]],
        streams: Callable[[], int],
    ) -> None:
        self._pages = pages
        self._bridges = bridges
        self._streams = streams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "replicaplane_dashboard_pages", "Pages connected now (open event streams).", value=self._pages()
        )
        by_state = self._bridges()
        bridges = GaugeMetricFamily(
            "replicaplane_dashboard_bridges",
            "API tokens the dashboard follows the fleet for now (pages with one token share one), "
            "by the state of their link to the controller.",
            labels=["state"],
        )
        for state in BRIDGE_STATES:
            bridges.add_metric([state], by_state.get(state, 0))
        yield bridges
        yield GaugeMetricFamily(
            "replicaplane_dashboard_controller_streams",
            "WatchService streams open to the controller now (one per service per followed token).",
            value=self._streams(),
        )


class DashboardMetrics:
    """The dashboard's metric families in `registry`."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self._registry = registry
        sent = prometheus_client.Counter(
            "replicaplane_dashboard_events_sent",
            "Server-Sent Events written to pages, by kind (keep-alive comments are not counted).",
            ["kind"],
            registry=registry,
        )
        connections = prometheus_client.Counter(
            "replicaplane_dashboard_page_connections",
            "Pages' event-stream requests by outcome: accepted; bad_token (401: not a bearer token); "
            "denied (401: the controller refused the token); full (503: max_pages are open).",
            ["outcome"],
            registry=registry,
        )
        # Children made up front: every series exists (at 0) before its first event.
        self._sent = {kind: sent.labels(kind) for kind in EVENT_KINDS}
        self._connections = {outcome: connections.labels(outcome) for outcome in OUTCOMES}

    def watch(
        self,
        *,
        pages: Callable[[], int],
        bridges: Callable[[], Mapping[str, int]],
        streams: Callable[[], int],
    ) -> None:
        """Report the pages, bridges by state and controller streams these callables count."""
        self._registry.register(_Live(pages, bridges, streams))

    def sent(self, kind: str) -> None:
        """Count one event written to a page."""
        self._sent[kind].inc()

    def connection(self, outcome: str) -> None:
        """Count one page's request for the event stream."""
        self._connections[outcome].inc()
