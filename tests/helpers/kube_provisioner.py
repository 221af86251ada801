"""A provisioner server on the kubernetes backend, pointed at the test API server (kube_emulator)."""

from __future__ import annotations

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from services.provisioner import server
from tests.helpers import kube_emulator


def settings(state_dir: str, emulator: kube_emulator.Emulator, instance: str, **overrides: object) -> server.Settings:
    """Settings for tests: short timeouts and backoffs, the emulator's kubeconfig and namespace."""
    values: dict[str, object] = {
        "listen_addr": "127.0.0.1:0",
        "state_dir": f"{state_dir}/state",
        "backend": "kubernetes",
        "kubernetes_kubeconfig": emulator.kubeconfig(f"{state_dir}/kubeconfig"),
        "kubernetes_namespace": emulator.namespace,
        "kubernetes_instance": instance,
        "kubernetes_port_annotation": kube_emulator.PORT_ANNOTATION,
        "kubernetes_schedule_timeout_s": 0.3,
        "kubernetes_delete_timeout_s": 0.5,
        "kubernetes_watch_timeout_s": 1,
        "kubernetes_watch_idle_s": 5,
        "kubernetes_api_attempts": 3,
        "kubernetes_api_backoff_s": 0.01,
        "kubernetes_api_backoff_max_s": 0.05,
        "launch_backoff_initial_s": 0.05,
        "launch_backoff_max_s": 0.1,
        "teardown_backoff_initial_s": 0.05,
        "teardown_backoff_max_s": 0.1,
        "kill_grace_s": 1.0,
    }
    values.update(overrides)
    return server.Settings(**values)  # type: ignore[arg-type]


class Running:
    """A started provisioner server and a stub to it."""

    def __init__(self, srv: server.Server, channel: grpc.aio.Channel) -> None:
        self.server = srv
        self.channel = channel
        self.stub = pb_grpc.ProvisionerServiceStub(channel)
        self.stopped = False

    async def stop(self) -> None:
        """Close the channel and stop the server (replicas keep running); once."""
        if not self.stopped:
            self.stopped = True
            await self.channel.close()
            await self.server.stop(None)


async def start(values: server.Settings) -> Running:
    """Build and start a provisioner server with `values`."""
    srv = await server.build_server(values)
    await srv.start()
    return Running(srv, grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}"))
