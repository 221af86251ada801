"""Balancer fleet: one process balancing every service of the controller, each on its own port.

The fleet lists the controller's services every `poll_s` and starts a unit (a balancer, its
controller link and its HTTP proxy) for each new one, pools excepted; a unit stops once its
service is gone. Ports count up from the first (30001), and a service keeps its port: across the
fleet's restarts through a small JSON file, and across fleet processes (several replicas of the
fleet, or a fleet restarted without its file) by taking the port of the URL the controller still
shows for the service when that URL is the fleet's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from services.loadbalancer import balancer as bal
from services.loadbalancer import link as ctl_link
from services.loadbalancer import proxy as px

log = logging.getLogger(__name__)

_PAGE = 1000


@dataclasses.dataclass
class Unit:
    """One service as the process balances it."""

    service: str
    balancer: bal.Balancer
    link: ctl_link.ControllerLink
    proxy: px.Proxy
    runner: Any
    http_port: int

    async def close(self) -> None:
        """Stop serving, then stop the link (its last report says the balancer is closing)."""
        await px.stop_http(self.runner, self.proxy)
        await self.link.stop()
        self.balancer.stats.unwatch()


class Ports:
    """The HTTP port of each service: `first`..`last`, kept in `path` (if set) across restarts.

    `first` 0 lets every service pick a free port (tests, several fleets on one machine). With
    `keep_any` a kept port outside `first`..`last` is still its service's (a fleet whose first port
    is picked afresh at each start).
    """

    def __init__(self, first: int, last: int, path: str = "", *, keep_any: bool = False) -> None:
        self.first = first
        self.last = last
        self.path = path
        self.keep_any = keep_any
        self.assigned: dict[str, int] = {}
        if path and os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
                self.assigned = {str(k): int(v) for k, v in raw.items() if isinstance(v, int) and self._kept(v)}
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("ignoring the fleet's port file %s (%s); ports are assigned afresh", path, exc)

    def candidates(self, service: str, *, in_use: set[int], hint: int = 0) -> Iterator[int]:
        """Ports to try for `service`, best first: its own port, the one the controller shows
        (`hint`), then free ports no other service had, then those of services not served now."""
        if self.first == 0:
            yield 0
            return
        tried: set[int] = set()
        own = self.assigned.get(service)
        for port in (own, hint):
            if port and self._kept(port) and port not in in_use and port not in tried:
                tried.add(port)
                yield port
        held = set(self.assigned.values())
        for port in range(self.first, self.last + 1):
            if port not in in_use and port not in held and port not in tried:
                tried.add(port)
                yield port
        for port in range(self.first, self.last + 1):
            if port not in in_use and port not in tried:
                tried.add(port)
                yield port

    def _kept(self, port: int) -> bool:
        return 0 < port <= 65535 if self.keep_any else self.first <= port <= self.last

    def assign(self, service: str, port: int) -> None:
        """Keep `port` for `service` (and for no other service)."""
        if self.first == 0 or self.assigned.get(service) == port:
            return
        self.assigned = {s: p for s, p in self.assigned.items() if p != port}
        self.assigned[service] = port
        if not self.path:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.assigned, f, sort_keys=True, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep the fleet's ports in %s (%s)", self.path, exc)


def port_of(url: str, host: str) -> int:
    """The port of `url` when it is on `host` (a URL this fleet may have reported), else 0."""
    try:
        parsed = urllib.parse.urlsplit(url)
        return (parsed.port or 0) if parsed.hostname == host else 0
    except ValueError:
        return 0


StartUnit = Callable[[str, int], Awaitable[Unit]]
"""Starts a unit for (service, port); raises OSError when the port cannot be bound."""


class Fleet:
    """Follows the controller's services and runs a unit for each."""

    def __init__(
        self,
        stub: api_grpc.ControllerServiceStub,
        *,
        ports: Ports,
        start_unit: StartUnit,
        advertise_host: str,
        poll_s: float = 1.0,
    ) -> None:
        self.stub = stub
        self.ports = ports
        self._start_unit = start_unit
        self.advertise_host = advertise_host
        self.poll_s = poll_s
        self.units: dict[str, Unit] = {}
        self.connected = False
        self._task: asyncio.Task[None] | None = None
        self._no_port: set[str] = set()  # services told about once: no free port in the range
        self._last_code: grpc.StatusCode | None = None

    def start(self) -> None:
        """Start following the controller's services."""
        self._task = asyncio.create_task(self._run(), name="balancer fleet")

    async def stop(self) -> None:
        """Stop following, then stop every unit."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        units, self.units = list(self.units.values()), {}
        await asyncio.gather(*(u.close() for u in units), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:
                log.exception("the fleet could not follow the controller's services; trying again")
            await asyncio.sleep(self.poll_s)

    async def services(self) -> dict[str, str]:
        """Every service to balance (pools have no URL) -> the URL the controller shows for it.

        Raises:
            grpc.aio.AioRpcError: the controller did not answer.
        """
        found: dict[str, str] = {}
        token = ""
        while True:
            page = await self.stub.ListServices(api.ListServicesRequest(page_size=_PAGE, page_token=token), timeout=5.0)
            for svc in page.services:
                if svc.spec.kind != spec_pb2.FLEET_KIND_POOL:
                    found[svc.name] = svc.load_balancer_url
            token = page.next_page_token
            if not token:
                return found

    async def sync(self) -> None:
        """One pass: start a unit for each new service, stop those of services gone. While the
        controller does not answer, every unit keeps serving."""
        try:
            wanted = await self.services()
        except grpc.aio.AioRpcError as exc:
            if self.connected or exc.code() != self._last_code:
                log.warning("could not list the controller's services (%s); trying again", exc.code().name)
            self.connected = False
            self._last_code = exc.code()
            return
        if not self.connected:
            log.info("following the controller's services: %d to balance", len(wanted))
        self.connected = True
        self._last_code = None
        for name in sorted(set(self.units) - set(wanted)):
            unit = self.units.pop(name)
            log.info("service %s is gone; port %d closes", name, unit.http_port)
            await unit.close()
        # The ports the controller shows go to their services first, and to no other service: a
        # fleet replica that starts beside another (or restarts without its file) takes the same
        # port for every service, so a Service in front of both routes each port to one service.
        hints = {name: port_of(url, self.advertise_host) for name, url in wanted.items()}
        for name in sorted((n for n in wanted if n not in self.units), key=lambda n: (hints[n] == 0, n)):
            await self._start(name, hints[name], reserved={p for n, p in hints.items() if p and n != name})

    async def _start(self, name: str, hint: int, *, reserved: AbstractSet[int] = frozenset()) -> None:
        in_use = {u.http_port for u in self.units.values()} | set(reserved)
        for port in self.ports.candidates(name, in_use=in_use, hint=hint):
            try:
                unit = await self._start_unit(name, port)
            except OSError as exc:
                log.warning("service %s: port %d is taken (%s); trying the next", name, port, exc.strerror or exc)
                continue
            self.ports.assign(name, unit.http_port)
            self.units[name] = unit
            self._no_port.discard(name)
            log.info("balancing service %s at %s", name, unit.link.url)
            return
        if name not in self._no_port:
            self._no_port.add(name)
            log.error(
                "service %s gets no URL: every port from %d to %d is taken; raise fleet_port_max",
                name,
                self.ports.first,
                self.ports.last,
            )

    def get(self, service: str) -> Unit | None:
        """The unit of `service`, if served."""
        return self.units.get(service)
