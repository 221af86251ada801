"""A balancer that cannot bind its HTTP address says which address and which setting, in one
line, rather than a traceback about its admin port."""

from __future__ import annotations

import socket

import pytest

from services.common import errors
from services.loadbalancer import server


async def test_a_taken_http_port_is_named_with_its_setting() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        settings = server.Settings(
            service_name="web",
            http_addr=taken,
            listen_addr="127.0.0.1:0",
            metrics_addr="",
            controller_addr="127.0.0.1:1",
        )
        with pytest.raises(errors.StartupError) as caught:
            await server.start(settings, start_admin=False)
    message = str(caught.value)
    assert message == (
        f"could not serve HTTP on {taken} (address already in use); "
        "set REPLICAPLANE_LOADBALANCER_HTTP_ADDR to a free address (port 0 picks one)"
    )
