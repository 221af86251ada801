"""A tiny configurable HTTP app for end-to-end tests (stdlib only).

Serves 200 on every path while healthy. Behaviour switches:
  --exit-code N --exit-after S   exit with code N after S seconds (app failure)
  --stop-file PATH               while PATH exists, answer 503 (stops being ready)
  --never-answer                 never listen at all (never becomes ready)
  --start-file PATH              do not listen until PATH exists (controls when ready starts)
  --ready-file PATH              write the time the app starts answering to PATH
"""

from __future__ import annotations

import argparse
import http.server
import os
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8080")))
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--exit-after", type=float, default=0.0)
    parser.add_argument("--stop-file", default="")
    parser.add_argument("--start-file", default="")
    parser.add_argument("--never-answer", action="store_true")
    parser.add_argument("--tag", default="", help="marker so tests can find the process")
    parser.add_argument("--ready-file", default="", help="write the time the app starts answering here")
    args = parser.parse_args()

    if args.exit_code is not None:
        time.sleep(args.exit_after)
        sys.exit(args.exit_code)
    if args.never_answer:
        while True:
            time.sleep(3600)
    while args.start_file and not os.path.exists(args.start_file):
        time.sleep(0.005)

    replica = os.environ.get("REPLICA_ID", "?")

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            if args.stop_file and os.path.exists(args.stop_file):
                code, body = 503, b"stopped\n"
            else:
                code, body = 200, f"hello from replica {replica}\n".encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = _answer
        do_POST = _answer

        def log_message(self, format: str, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if args.ready_file:
        with open(args.ready_file, "w") as fh:
            fh.write(repr(time.time()))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
