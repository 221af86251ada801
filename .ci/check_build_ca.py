#!/usr/bin/env python3
"""Fail if an image holds a private certificate of the CA bundle its build was given.

    docker save IMAGE | .ci/check_build_ca.py --bundle /etc/ssl/certs/ca-certificates.crt

A certificate is private when it is in the bundle but not among the public roots Debian ships
(`--public`, default /usr/share/ca-certificates): a proxy's or a company's CA. Those may help a
build reach PyPI but must never end up in the image. The saved image (every layer, its history
and config, uncompressed) is searched for each private certificate as PEM text (any line
wrapping) and as DER bytes. Standard library only. Exit 0 when none is found, 1 when one is,
2 on bad input.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import BinaryIO

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
_NEEDLE = 32
# Common PEM line lengths; a base64 needle is cut where no line break of these can fall.
_WRAPS = (64, 76)


def certificates(pem_text: bytes) -> list[bytes]:
    """The DER bytes of every PEM certificate in `pem_text`."""
    return [base64.b64decode(b"".join(m.group(1).split())) for m in _PEM.finditer(pem_text)]


def read_certificates(paths: Iterable[str]) -> list[bytes]:
    """Every certificate in the given files, and in the *.crt/*.pem files under given directories."""
    found: list[bytes] = []
    for path in paths:
        files = [path]
        if os.path.isdir(path):
            files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith((".crt", ".pem"))]
        for name in sorted(files):
            with open(name, "rb") as fh:
                found.extend(certificates(fh.read()))
    return found


def needles(der: bytes) -> list[bytes]:
    """Byte strings that identify one certificate wherever it is stored as PEM or DER."""
    text = base64.b64encode(der)
    start = next(
        s
        for s in range(len(text) // 3, len(text) - _NEEDLE)
        if not any((s // w) != ((s + _NEEDLE - 1) // w) for w in _WRAPS)
    )
    middle = len(der) // 2
    return [text[start : start + _NEEDLE], der[middle : middle + _NEEDLE]]


def found_in(stream: BinaryIO, patterns: dict[bytes, str]) -> set[str]:
    """Names of the patterns that occur anywhere in `stream`, read in chunks."""
    longest = max((len(p) for p in patterns), default=1)
    hits: set[str] = set()
    tail = b""
    for chunk in _chunks(stream):
        window = tail + chunk
        hits.update(name for pattern, name in patterns.items() if pattern in window)
        tail = window[-(longest - 1) :] if longest > 1 else b""
    return hits


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(1 << 20):
        yield chunk


def main(argv: list[str] | None = None) -> int:
    """Check the saved image on stdin; print one line with the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, help="the CA bundle the build was given")
    parser.add_argument(
        "--public",
        action="append",
        help="public roots: files or directories (default /usr/share/ca-certificates); repeatable",
    )
    parser.add_argument("--image", default="the image", help="name to print")
    args = parser.parse_args(argv)
    try:
        bundle = read_certificates([args.bundle])
        public = set(read_certificates(args.public or ["/usr/share/ca-certificates"]))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not public:
        print("error: no public roots found; give --public", file=sys.stderr)
        return 2
    private = {der: hashlib.sha256(der).hexdigest()[:16] for der in bundle if der not in public}
    if not private:
        print(f"{args.bundle}: no private certificates, nothing to look for")
        return 0
    patterns = {needle: fingerprint for der, fingerprint in private.items() for needle in needles(der)}
    hits = found_in(sys.stdin.buffer, patterns)
    if hits:
        print(f"FAIL: {args.image} holds private CA certificates of {args.bundle}: sha256 {', '.join(sorted(hits))}")
        return 1
    print(f"{args.image} holds none of the {len(private)} private CA certificates of {args.bundle}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
