"""Client channels with the shared keepalive and retry policy."""

from __future__ import annotations

import ipaddress
import json
import socket

import grpc

# Retry only UNAVAILABLE, and only where the call is safe to repeat: the service config below
# applies to every method, so callers must not send non-idempotent work through it without a
# request id. Streams are never retried by gRPC once a response arrived.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

# Over a Unix socket there is no host to check a certificate against: it must carry this name.
UNIX_SERVER_NAME = "localhost"

CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", _SERVICE_CONFIG),
    # Reconnect fast after a peer restarts: the default backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


_RETRY_OPTIONS = frozenset({"grpc.enable_retries", "grpc.service_config"})


def channel(
    target: str,
    *,
    extra_options: list[tuple[str, object]] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str = "",
    interceptors: list[grpc.aio.ClientInterceptor] | None = None,
    retries: bool = True,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` (host:port, dns:///name:port, ipv4:a,b).

    Args:
        target: where to connect.
        extra_options: channel options added to the shared ones.
        credentials: TLS credentials; None means plaintext.
        server_name: the name the server's certificate must carry, when it is not the target host
            (for unix: targets, UNIX_SERVER_NAME).
        interceptors: client interceptors, for example security.token_interceptors().
        retries: False for a caller that retries at its own layer (and must know how many
            attempts were made), so gRPC does not retry underneath it.
    """
    shared = CHANNEL_OPTIONS if retries else [o for o in CHANNEL_OPTIONS if o[0] not in _RETRY_OPTIONS]
    options = shared + [("grpc.enable_retries", 0)] * (not retries) + (extra_options or [])
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    if not server_name and target.startswith("unix:"):
        server_name = UNIX_SERVER_NAME
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


def controller_target(addrs: str) -> str:
    """The gRPC target for a controller given as one address or several (`a:50051,b:50051`).

    With several (controllers sharing a store, one leading), one channel uses whichever answers:
    it connects to the first it can reach (pick_first, in the order given) and moves on when that
    one stops answering; a standby forwards the calls it gets to the leader. Host names are
    resolved here, once (the target lists addresses).

    Args:
        addrs: `host:port`, `unix:PATH`, `dns:///name:port`, or a comma-separated `host:port` list.

    Returns:
        A target for `channel()` or `grpc.insecure_channel()`.

    Raises:
        ValueError: a list with something other than host:port in it, or a name that does not
            resolve.
    """
    parts = [a.strip() for a in addrs.split(",") if a.strip()]
    if len(parts) <= 1:
        return addrs.strip()
    found: list[tuple[str, str]] = []  # (ip, port)
    for part in parts:
        host, _, port = part.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or part.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
            raise ValueError(f"{part!r} in a list of controller addresses must be host:port")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"cannot resolve {host!r}: {exc.strerror}") from None
        v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
        found.append((str(v4[0] if v4 else infos[0][4][0]), port))
    if all(ipaddress.ip_address(ip).version == 4 for ip, _ in found):
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in found)
    return "ipv6:" + ",".join(f"[{_as_v6(ip)}]:{port}" for ip, port in found)


def _as_v6(ip: str) -> str:
    return ip if ipaddress.ip_address(ip).version == 6 else f"::ffff:{ip}"
