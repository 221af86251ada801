"""Opaque page tokens (AIP-158): where the next page of one listing starts.

A token holds the listing it belongs to (a kind such as "services", and its filter, such as the
service name) and the last key of the page, with a checksum. `decode` refuses anything else
(a made-up or truncated token, one from another listing) as INVALID_ARGUMENT `page_token`,
instead of silently listing from wherever the text happens to sort. The checksum catches
mistakes, not forgery: a forged token only starts a listing the caller could read anyway.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json

from services.common import errors

FIELD = "page_token"
# Tokens carry one key of at most a few hundred characters; anything longer is not ours.
MAX_TOKEN_CHARS = 1024
_VERSION = 1
_CHECK_BYTES = 8
_SALT = b"replicaplane page token\n"

Position = str | int


def encode(kind: str, scope: str, position: Position) -> str:
    """The token for the page after `position` of listing (`kind`, `scope`).

    Args:
        kind: Which listing, such as "services" or "replicas".
        scope: The listing's filter (a service name), "" for none.
        position: The last key of the page just returned.

    Returns:
        URL-safe text without padding.
    """
    body = json.dumps([_VERSION, kind, scope, position], separators=(",", ":")).encode()
    raw = _check(body) + body
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode(token: str, kind: str, scope: str, *, position_type: type[str] | type[int]) -> Position:
    """The position a token of listing (`kind`, `scope`) holds.

    Args:
        token: A `next_page_token` the caller sent back.
        kind: The listing being read.
        scope: Its filter.
        position_type: The type of the listing's keys.

    Returns:
        The last key of the previous page.

    Raises:
        errors.ValidationError: the token was not made by `encode` for this listing.
    """
    bad = errors.ValidationError(
        [errors.FieldViolation(FIELD, "must be the next_page_token of an earlier page of the same listing")]
    )
    if not token.isascii() or len(token) > MAX_TOKEN_CHARS:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError):
        raise bad from None
    check, body = raw[:_CHECK_BYTES], raw[_CHECK_BYTES:]
    if len(check) != _CHECK_BYTES or check != _check(body):
        raise bad
    try:
        version, got_kind, got_scope, position = json.loads(body)
    except (ValueError, TypeError):
        raise bad from None
    if (version, got_kind, got_scope) != (_VERSION, kind, scope):
        raise bad
    # bool is an int to Python, never a key here.
    if not isinstance(position, position_type) or isinstance(position, bool):
        raise bad
    return position


def _check(body: bytes) -> bytes:
    return hashlib.sha256(_SALT + body).digest()[:_CHECK_BYTES]
