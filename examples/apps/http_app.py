"""A tiny stdlib HTTP app for tests: answers every GET with 200 and a JSON line naming itself.

The port comes from the first argument, else env PORT (the local backend sets it and also
substitutes the spec's port in the command). Exits 0 on SIGTERM.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    """200 with {"replica_id", "port", "path"} for every GET."""

    def do_GET(self) -> None:
        """Answer a GET."""
        body = json.dumps(
            {
                "replica_id": os.environ.get("REPLICA_ID", ""),
                "port": self.server.server_address[1],
                "path": self.path,
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Log requests to stdout (the app log)."""
        print(f"{self.address_string()} {format % args}", flush=True)


def main() -> None:
    """Serve until SIGTERM."""
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("PORT", "8080"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"serving on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
