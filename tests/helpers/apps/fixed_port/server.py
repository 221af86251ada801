"""An app as SkyPilot's examples/serve/http_server writes it: a fixed port, every interface.

It ignores $PORT and $HOST, so replicas of it only coexist on one machine if the backend
isolates their addresses.
"""

import http.server
import os
import socketserver


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"replica {os.environ.get('REPLICA_ID', '?')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    with socketserver.TCPServer(("", 8080), Handler) as httpd:
        httpd.serve_forever()
