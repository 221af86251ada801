"""What replicactl reads besides the YAML: `--env`, `--env-file` and `--secret` values, and the
name it makes up for a service that has none.

Errors are one line naming the flag and the key, never a value (a secret may be in it).
"""

from __future__ import annotations

import random
import re
import secrets as secrets_mod
from collections.abc import Mapping, Sequence

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_RULE = "not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}

# Short, plain words: a generated name reads like `service-brisk-3f2a` in a table or a URL.
_ADJECTIVES = (
    "amber", "bold", "brave", "brisk", "calm", "clear", "cool", "crisp", "eager", "early",
    "fair", "fast", "fresh", "gentle", "glad", "grand", "happy", "keen", "kind", "light",
    "lively", "lucky", "merry", "mild", "neat", "nimble", "noble", "proud", "quick", "quiet",
    "rapid", "ready", "sharp", "shiny", "smart", "snappy", "solid", "steady", "sunny", "swift",
    "tidy", "vivid", "warm", "wise", "witty", "young", "zesty",
)  # fmt: skip


class InputError(Exception):
    """A flag or file replicactl cannot use; the message names it (without `error: `)."""


def generate_name(rng: random.Random | None = None) -> str:
    """A readable service name that is very likely unused: `service-<adjective>-<4 hex>`.

    It is a valid service name (lowercase, digits and '-'), as SkyPilot's `sky-service-<4 hex>`.
    """
    word = (rng or random.SystemRandom()).choice(_ADJECTIVES)
    suffix = f"{rng.getrandbits(16):04x}" if rng else secrets_mod.token_hex(2)
    return f"service-{word}-{suffix}"


def overrides(
    *,
    envs: Sequence[str],
    env_files: Sequence[str],
    secrets: Sequence[str],
    environ: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, str]]:
    """The env and secret overrides the flags give, SkyPilot's way.

    `--env-file` lines come first, then each `--env` (a later one wins). `KEY=VALUE` sets a
    value; a bare `KEY` takes the caller's environment variable of that name.

    Args:
        envs: `--env` values, `KEY` or `KEY=VALUE`.
        env_files: `--env-file` paths (dotenv format).
        secrets: `--secret` values, `KEY` or `KEY=VALUE`.
        environ: the caller's environment.

    Returns:
        (envs, secrets) to send with the request.

    Raises:
        InputError: a bad key, a bare key not set in `environ`, an unreadable or bad file.
    """
    env_out: dict[str, str] = {}
    for path in env_files:
        for key, value, line_no in _read_env_file(path):
            env_out[key] = _value(key, value, environ, f"--env-file {path}:{line_no}")
    _add("--env", envs, env_out, environ)
    secret_out: dict[str, str] = {}
    _add("--secret", secrets, secret_out, environ)
    return env_out, secret_out


def _add(flag: str, given: Sequence[str], out: dict[str, str], environ: Mapping[str, str]) -> None:
    for item in given:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not _ENV_NAME_RE.fullmatch(key):
            raise InputError(f"{flag} {key[:64]}: {_NAME_RULE}")
        out[key] = _value(key, value if sep else None, environ, f"{flag} {key}")


def _value(key: str, value: str | None, environ: Mapping[str, str], where: str) -> str:
    if value is not None:
        return value
    if key not in environ:
        raise InputError(f"{where}: {key} is not set in your environment (or give {key}=VALUE)")
    return environ[key]


def _read_env_file(path: str) -> list[tuple[str, str | None, int]]:
    """(key, value or None for a bare key, line number) for each setting of a dotenv file.

    Lines are `KEY=VALUE`, `export KEY=VALUE` or a bare `KEY`; `#` starts a comment outside
    quotes; single quotes keep the text as is, double quotes take `\\n`-style escapes. No
    `${VAR}` expansion.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise InputError(f"--env-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--env-file {path}: cannot read it ({type(exc).__name__})") from None
    out: list[tuple[str, str | None, int]] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--env-file {path}:{line_no}"
        if line.startswith("export ") or line.startswith("export\t"):
            line = line[len("export") :].lstrip()
        key, sep, rest = line.partition("=")
        key = key.strip()
        if not sep:
            if not _ENV_NAME_RE.fullmatch(key):
                raise InputError(f"{where}: expected KEY=VALUE")
            out.append((key, None, line_no))
            continue
        if not _ENV_NAME_RE.fullmatch(key):
            if key and " " not in key:
                raise InputError(f"{where}: {key[:64]}: {_NAME_RULE}")
            raise InputError(f"{where}: expected KEY=VALUE")
        out.append((key, _dotenv_value(rest.strip(), where), line_no))
    return out


def _dotenv_value(text: str, where: str) -> str:
    if text[:1] == "'":
        end = text.find("'", 1)
        if end < 0:
            raise InputError(f"{where}: unterminated quote")
        _only_comment(text[end + 1 :], where)
        return text[1:end]
    if text[:1] == '"':
        value: list[str] = []
        i = 1
        while i < len(text):
            ch = text[i]
            if ch == "\\" and i + 1 < len(text):
                value.append(_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
                i += 2
                continue
            if ch == '"':
                _only_comment(text[i + 1 :], where)
                return "".join(value)
            value.append(ch)
            i += 1
        raise InputError(f"{where}: unterminated quote")
    # Unquoted: a `#` after a space starts a comment.
    return re.split(r"\s+#", text, maxsplit=1)[0].strip()


def _only_comment(rest: str, where: str) -> None:
    rest = rest.strip()
    if rest and not rest.startswith("#"):
        raise InputError(f"{where}: text after the closing quote")
