"""A tiny stdlib-only HTTP app for Replicaplane's example service.

`/` answers with a hello naming the replica (env REPLICA_ID), `/health` answers 200 for the
readiness probe. With env HELLO_FAIL set, it prints that reason and exits 1 at once (the
broken-v2 example). The port comes from `--port` or env PORT (the local backend sets both); the
address from `--host` or env HOST, loopback by default.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys

REPLICA_ID = os.environ.get("REPLICA_ID", "?")


class Handler(http.server.BaseHTTPRequestHandler):
    """Serves `/` and `/health`; everything else is 404."""

    server_version = "hello/1"

    def do_GET(self) -> None:
        """Answer GET requests."""
        if self.path == "/health":
            self._send(200, {"status": "ok", "replica_id": REPLICA_ID})
        elif self.path == "/":
            self._send(200, {"message": f"hello from replica {REPLICA_ID}", "replica_id": REPLICA_ID})
        else:
            self._send(404, {"error": "not found"})

    def _send(self, code: int, body: dict[str, str]) -> None:
        data = (json.dumps(body) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Log each request to stdout, where the backend collects the app's output."""
        print(f"replica {REPLICA_ID}: {self.address_string()} {format % args}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and serve until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8080")))
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    args = parser.parse_args(argv)
    if os.environ.get("HELLO_FAIL"):
        # The broken-v2 example: a version that cannot start, as a bad release would.
        print(f"replica {REPLICA_ID}: cannot start: {os.environ['HELLO_FAIL']}", flush=True)
        sys.exit(1)

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True

    # Exit 0 on SIGTERM: a replica stopped by its teardown did not fail.
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"replica {REPLICA_ID}: serving on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        print(f"replica {REPLICA_ID}: stopped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
