"""Composition root of the controller: settings, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses

from replicaplane.controller.v1 import controller_service_pb2, controller_service_pb2_grpc
from services.common import config, grpc_server, logs

SERVICE_NAME = controller_service_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name


@dataclasses.dataclass(frozen=True)
class Settings:
    """Controller settings; env REPLICAPLANE_CONTROLLER_<FIELD> overrides each."""

    listen_addr: str = config.CONTROLLER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""
    state_dir: str = "~/.replicaplane/controller"
    """Directory of the SQLite store."""
    provisioner_addr: str = config.PROVISIONER_ADDR
    """Where the provisioner listens."""
    prober_addrs: str = config.PROBER_ADDR
    """Probers: a comma-separated address list, or `dns:///name:port` resolving to every prober."""


def load_settings(**overrides: object) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "controller", **overrides)


async def build_server(settings: Settings) -> grpc_server.Built:
    """Create the controller server; the caller starts and stops it."""
    server = grpc_server.new_server(domain="controller.replicaplane")
    controller_service_pb2_grpc.add_ControllerServiceServicer_to_server(
        controller_service_pb2_grpc.ControllerServiceServicer(), server
    )
    return grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME])


async def serve(settings: Settings) -> None:
    """Run until SIGTERM."""
    built = await build_server(settings)
    await grpc_server.serve_until_signal(built, grace=settings.shutdown_grace_s, port_file=settings.port_file)


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("controller")
    asyncio.run(serve(load_settings()))
