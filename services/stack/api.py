"""Controller and health-check calls the stack makes, and the lines it prints while watching."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc
from services.common import clients, security, specfile, watchlines

Out = Callable[[str], None]


class StackError(Exception):
    """A step of the stack failed; the message says which and why."""


resolve_paths = specfile.resolve_paths
read_spec = specfile.read_spec
spec_name = specfile.spec_name
WatchPrinter = watchlines.WatchPrinter


def _health_channel(addr: str, tls: bool) -> grpc.aio.Channel:
    credentials = security.client_tls() if tls else None
    if credentials is None:
        return grpc.aio.insecure_channel(addr)
    options = [("grpc.ssl_target_name_override", clients.UNIX_SERVER_NAME)] if addr.startswith("unix:") else []
    return grpc.aio.secure_channel(addr, credentials, options=options)


async def wait_serving(
    addr: str, service: str, *, timeout: float, alive: Callable[[], bool] = lambda: True, tls: bool = False
) -> None:
    """Wait until the gRPC health check of `service` at `addr` says SERVING.

    Args:
        addr: host:port or unix:PATH.
        service: the gRPC service name to check.
        timeout: seconds to wait.
        alive: false once the process is gone.
        tls: check over mTLS with the credentials of security.client_tls().

    Raises:
        StackError: the process died (`alive()` is false) or `timeout` seconds passed.
    """
    deadline = time.monotonic() + timeout
    async with _health_channel(addr, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not alive():
                raise StackError(f"{service} at {addr} exited before it was serving")
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() >= deadline:
                raise StackError(f"{service} at {addr} was not serving after {timeout:.0f} s")
            await asyncio.sleep(0.1)


async def check_health(addr: str, service: str = "", *, timeout: float = 3.0, tls: bool = False) -> bool:
    """One health check: True when `service` ("" = the whole server) at `addr` is SERVING."""
    async with _health_channel(addr, tls) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


class Controller:
    """The few ControllerService calls the stack needs, over one channel."""

    def __init__(self, addr: str, *, token: str | None = None) -> None:
        self.addr = addr
        # Without a token given: the environment's, or the local stack's for its controller.
        if token is None:
            token = security.client_token(target=addr)
        self._channel = clients.channel(addr, interceptors=security.token_interceptors(token))
        self._stub = controller_service_pb2_grpc.ControllerServiceStub(self._channel)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def create(self, yaml_path: str, out: Out) -> str:
        """Create the service in `yaml_path`; adopt it if it already exists.

        Returns:
            The service name.

        Raises:
            StackError: the controller refused the spec or could not be reached.
        """
        try:
            text = await asyncio.to_thread(read_spec, yaml_path)
        except specfile.PathError as exc:
            raise StackError(f"creating {yaml_path} failed: {exc}") from None
        request = pb.CreateServiceRequest(yaml=text, request_id=str(uuid.uuid4()))
        try:
            resp = await self._stub.CreateService(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.ALREADY_EXISTS:
                name = (yaml.safe_load(text) or {}).get("name", "")
                out(f"{name}: already exists (left from an earlier run); following it")
                return str(name)
            raise StackError(f"creating {yaml_path} failed: {err.code().name}: {err.details()}") from None
        out(f"{resp.service.name}: created from {yaml_path}")
        return resp.service.name

    async def follow(self, name: str, printer: WatchPrinter, out: Out, *, say_not_found: bool = True) -> bool:
        """Print `name`'s changes until it is deleted or the task is cancelled.

        A cut stream is resumed from the last sequence number seen, with a growing pause.

        Returns:
            True once the service is gone (deleted, or not found); False if the controller
            cannot watch services.
        """
        after = 0
        failures = 0
        while True:
            try:
                call = self._stub.WatchService(pb.WatchServiceRequest(service_name=name, after_sequence=after))
                async for resp in call:
                    failures = 0
                    after = resp.sequence
                    for line in printer.lines(resp):
                        out(line)
                    if resp.deleted:
                        return True
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    if say_not_found:
                        out(f"{name}: not found")
                    return True
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    out(f"{name}: the controller cannot watch services yet; not following")
                    return False
                if failures == 0:
                    out(f"{name}: watch interrupted ({err.code().name}); reconnecting")
                failures += 1
            await asyncio.sleep(min(0.2 * 2**failures, 5.0))

    async def follow_all(self, out: Out, *, first: Sequence[str] = (), interval: float = 1.0, limit: int = 100) -> None:
        """Print the changes of every service, the ones created later included, until cancelled.

        `ListServices` every `interval` seconds finds new services (the controller has no watch
        over all of them); each gets a follower until it is deleted, and a service created again
        under the same name gets a new one. At most `limit` services are followed at once.

        Args:
            out: where lines go.
            first: services to follow at once, before the first listing (the stack's example).
            interval: seconds between listings.
            limit: most services followed at once; the others are named once.
        """
        printer = WatchPrinter()
        followers: dict[str, asyncio.Task[bool]] = {}
        unwatchable: set[str] = set()
        skipped: set[str] = set()
        known = set(first)
        listing_failed = False

        def start(name: str) -> None:
            if name in unwatchable:
                return
            task = followers.get(name)
            if task is not None and not task.done():
                return
            if task is not None and not task.result():
                unwatchable.add(name)
                return
            if sum(not t.done() for t in followers.values()) >= limit:
                if name not in skipped:
                    skipped.add(name)
                    out(f"{name}: not followed here ({limit} services already are; see `replicactl status`)")
                return
            if name not in known:
                out(f"{name}: found; following it")
                known.add(name)
            skipped.discard(name)
            followers[name] = asyncio.create_task(self.follow(name, printer, out, say_not_found=False))

        try:
            for name in first:
                start(name)
            while True:
                try:
                    names = await self.list_names()
                    listing_failed = False
                except StackError as exc:
                    if not listing_failed:
                        out(f"looking for new services failed ({exc}); retrying")
                    listing_failed = True
                    names = []
                for name in names:
                    start(name)
                # Deleted services: a name created again later is announced again.
                known &= set(names) | {n for n, t in followers.items() if not t.done()}
                await asyncio.sleep(interval)
        finally:
            for task in followers.values():
                task.cancel()
            await asyncio.gather(*followers.values(), return_exceptions=True)

    async def list_names(self) -> list[str]:
        """Every service the controller has, in name order (all pages).

        Raises:
            StackError: the controller could not be reached.
        """
        names: list[str] = []
        token = ""
        for _ in range(10_000):  # bounded: 1,000 per page
            try:
                resp = await self._stub.ListServices(
                    pb.ListServicesRequest(page_size=1000, page_token=token), timeout=10
                )
            except grpc.aio.AioRpcError as err:
                raise StackError(f"listing services failed: {err.code().name}: {err.details()}") from None
            names += [s.name for s in resp.services]
            token = resp.next_page_token
            if not token:
                break
        return names

    async def delete_everything(self, *, timeout: float, out: Out, also: Sequence[str] = ()) -> list[str]:
        """Delete every service the controller has (plus `also`) and wait until each is gone.

        Returns:
            The names of services still there (empty when everything is deleted).
        """
        try:
            names = sorted(set(await self.list_names()) | set(also))
        except StackError as exc:
            out(f"error: {exc}")
            return sorted(set(also)) or ["(unknown: the controller did not answer)"]
        results = await asyncio.gather(*(self.delete_and_wait(n, timeout=timeout, out=out) for n in names))
        left = [n for n, ok in zip(names, results, strict=True) if not ok]
        if left:
            out(f"services left: {', '.join(left)} (their replicas may still run)")
        else:
            out(f"services left: none ({len(names)} deleted)")
        return left

    async def delete_and_wait(self, name: str, *, timeout: float, out: Out) -> bool:
        """Delete `name` and wait (at most `timeout` s) until the controller says NOT_FOUND.

        Returns:
            True once the service is gone; False if it could not be confirmed in time.
        """
        try:
            await self._stub.DeleteService(pb.DeleteServiceRequest(service_name=name), timeout=10)
            out(f"{name}: deleting")
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return True
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:  # already shutting down: wait
                out(f"{name}: DeleteService failed: {err.code().name}: {err.details()}")
                return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                await self._stub.GetService(pb.GetServiceRequest(service_name=name), timeout=5)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return True
            await asyncio.sleep(0.25)
        out(f"{name}: still not deleted after {timeout:.0f} s")
        return False
