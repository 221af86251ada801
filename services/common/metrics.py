"""Prometheus metrics of one process: its registry and the `/metrics` HTTP endpoint.

Every service keeps its metrics in its own registry (not prometheus_client's global one), so
several servers in one test process never collide. The registry holds the process and Python
collectors and `replicaplane_build_info`; the gRPC interceptor (grpc_metrics.py) and each
service's own metrics register into it. The endpoint is an aiohttp server on the service's
event loop: collectors that read the service's state run on the loop that changes it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os
import re
import socket
import subprocess

import prometheus_client
from aiohttp import web
from prometheus_client import exposition

log = logging.getLogger(__name__)

PATH = "/metrics"

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")

GIT_COMMIT_ENV = "REPLICAPLANE_GIT_COMMIT"
"""Set by the container build (no .git there); wins over asking git."""


@functools.cache
def version() -> str:
    """The installed package's version, or "unknown"."""
    try:
        return importlib.metadata.version("replicaplane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def git_commit() -> str:
    """The commit this code was built from: $REPLICAPLANE_GIT_COMMIT, else the checkout's HEAD,
    else "" (not known)."""
    given = os.environ.get(GIT_COMMIT_ENV, "").strip().lower()
    if given:
        return given[:12] if _COMMIT.match(given) else ""
    if not os.path.exists(os.path.join(_REPO, ".git")):
        return ""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=_REPO,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and _COMMIT.match(commit) else ""


class Metrics:
    """The metrics registry of one service process.

    Args:
        component: controller, provisioner, prober, loadbalancer or dashboard (the build info's label).
    """

    def __init__(self, component: str) -> None:
        # `*_created` series (one per counter and histogram child) double what is stored and
        # say nothing a counter reset does not; a process-wide switch, the same for every registry.
        prometheus_client.disable_created_metrics()
        self.component = component
        self.registry = prometheus_client.CollectorRegistry()
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        build = prometheus_client.Gauge(
            "replicaplane_build_info",
            "Always 1; the labels say which build runs (git_commit is empty when not known).",
            ["component", "version", "git_commit"],
            registry=self.registry,
        )
        build.labels(component, version(), git_commit()).set(1)

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the text format the `Accept` header asks for, and its content type."""
        encoder, content_type = exposition.choose_encoder(accept or "")
        return encoder(self.registry), content_type


def for_address(component: str, metrics_addr: str) -> Metrics | None:
    """A Metrics for a service whose `metrics_addr` setting is given; None when it is empty
    (metrics off: no registry, no gRPC interceptor, no endpoint)."""
    return Metrics(component) if metrics_addr.strip() else None


def split_addr(addr: str) -> tuple[str, int]:
    """host and port of `host:port` (an IPv6 host may be in brackets).

    Raises:
        ValueError: not host:port with a numeric port.
    """
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def url_host(host: str) -> str:
    """The host to put in a URL for a server bound to `host` (a wildcard becomes loopback)."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


@dataclasses.dataclass
class Endpoint:
    """A running `/metrics` endpoint."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """The URL to scrape."""
        return f"http://{url_host(self.host)}:{self.port}{PATH}"

    async def stop(self) -> None:
        """Stop serving."""
        await self.runner.cleanup()


async def serve(metrics: Metrics, addr: str) -> Endpoint:
    """Serve `metrics` on http://addr/metrics (port 0 picks a free port).

    Raises:
        ValueError: `addr` is not host:port.
        OSError: the address cannot be bound (in use, not local).
    """
    host, port = split_addr(addr)

    async def scrape(request: web.Request) -> web.Response:
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=f"Replicaplane {metrics.component}: metrics at {PATH}\n")

    app = web.Application()
    app.router.add_get(PATH, scrape)
    app.router.add_get("/", index)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host or "0.0.0.0", port))
        sock.listen(128)
        sock.setblocking(False)
        site = web.SockSite(runner, sock)
        await site.start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    bound = sock.getsockname()[1]
    return Endpoint(runner=runner, host=host, port=int(bound))
