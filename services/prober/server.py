"""Composition root of the prober: settings, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses

from replicaplane.prober.v1 import prober_service_pb2, prober_service_pb2_grpc
from services.common import config, grpc_server, logs

SERVICE_NAME = prober_service_pb2.DESCRIPTOR.services_by_name["ProberService"].full_name


@dataclasses.dataclass(frozen=True)
class Settings:
    """Prober settings; env REPLICAPLANE_PROBER_<FIELD> overrides each."""

    listen_addr: str = config.PROBER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""


def load_settings(**overrides: object) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "prober", **overrides)


async def build_server(settings: Settings) -> grpc_server.Built:
    """Create the prober server; the caller starts and stops it."""
    server = grpc_server.new_server(domain="prober.replicaplane")
    prober_service_pb2_grpc.add_ProberServiceServicer_to_server(
        prober_service_pb2_grpc.ProberServiceServicer(), server
    )
    return grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME])


async def serve(settings: Settings) -> None:
    """Run until SIGTERM."""
    built = await build_server(settings)
    await grpc_server.serve_until_signal(built, grace=settings.shutdown_grace_s, port_file=settings.port_file)


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("prober")
    asyncio.run(serve(load_settings()))
