"""A replica app for load balancer tests (aiohttp), run as a process or in-process.

Paths:
  /health                 200
  /whoami                 "replica N" (then the --say text, if any); with --fail-every K, every
                          K-th answer is a 500
  /slow?s=S               answers "replica N" after S seconds
  /stream?words=N&delay=S N words, one chunk each, S seconds apart
  /status/CODE            answers CODE with a body naming the replica
  /work?ticks=N&delay=S&marker=PATH
                          streams a tick every S seconds; writes "done N" or "cancelled N" (ticks
                          sent) to PATH, so a test sees whether a client disconnect stopped the work
  /echo                   JSON of method, path, query, headers and body
  /sink                   reads the body as it arrives (keeping none of it) and answers its size
"""

from __future__ import annotations

import argparse
import asyncio
import os

from aiohttp import web


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def make_app(replica: str, *, say: str = "", fail_every: int = 0) -> web.Application:
    """The app, answering as replica `replica`."""
    answered = 0
    me = f"replica {replica} {say}".rstrip()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def whoami(request: web.Request) -> web.Response:
        nonlocal answered
        answered += 1
        if fail_every and answered % fail_every == 0:
            return web.Response(status=500, text=f"{me} failed\n")
        return web.Response(text=f"{me}\n")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "1")))
        return web.Response(text=f"replica {replica}\n")

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        for i in range(int(request.query.get("words", "5"))):
            if i:
                await asyncio.sleep(float(request.query.get("delay", "0.2")))
            await resp.write(f"word{i} ".encode())
        await resp.write_eof()
        return resp

    async def status(request: web.Request) -> web.Response:
        code = int(request.match_info["code"])
        return web.Response(status=code, text=f"status {code} from replica {replica}\n")

    async def work(request: web.Request) -> web.StreamResponse:
        marker = request.query["marker"]
        ticks, delay = int(request.query.get("ticks", "100")), float(request.query.get("delay", "0.05"))
        sent = 0
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for _ in range(ticks):
                await resp.write(b"tick\n")
                sent += 1
                await asyncio.sleep(delay)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            _write(marker, f"cancelled {sent}")
            raise
        _write(marker, f"done {sent}")
        return resp

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "replica": replica,
                "method": request.method,
                "path": request.path,
                "raw_path": request.raw_path,
                "headers": dict(request.headers),
                "body": body.decode(errors="replace"),
            }
        )

    async def sink(request: web.Request) -> web.Response:
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
        return web.json_response({"replica": replica, "bytes": size})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/whoami", whoami)
    app.router.add_get("/slow", slow)
    app.router.add_get("/stream", stream)
    app.router.add_route("*", "/status/{code}", status)
    app.router.add_get("/work", work)
    app.router.add_route("*", "/echo", echo)
    app.router.add_route("*", "/sink", sink)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8080")))
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--tag", default="", help="marker so tests can find the process")
    parser.add_argument("--say", default="", help="words /whoami adds after the replica id")
    parser.add_argument("--fail-every", type=int, default=0, help="every K-th /whoami answers 500")
    args = parser.parse_args()
    web.run_app(
        make_app(os.environ.get("REPLICA_ID", "?"), say=args.say, fail_every=args.fail_every),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
