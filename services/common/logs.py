"""Logging setup that keeps secrets (probe headers, tokens) out of every log line."""

from __future__ import annotations

import logging
import os
import re
import sys
import types
from collections.abc import Mapping

from services.common import errors

REDACTED = "<redacted>"

# Header names whose values are secret; matched case-insensitively. Every probe header is
# treated as secret by callers anyway (redact_headers); this pattern is a second net for text.
_SECRET_TEXT = re.compile(
    r"(?i)(authorization|proxy-authorization|x-api-key|api[_-]?key|token|secret|password|cookie)"
    r"(['\"]?\s*[:=]\s*['\"]?)(bearer\s+|basic\s+)?[^\s'\",}]+"
)


def redact_text(text: str) -> str:
    """Replace values that look like credentials in free text."""
    return _SECRET_TEXT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Return the header names with every value hidden: all probe headers are secret."""
    return dict.fromkeys(headers, REDACTED)


class RedactingFilter(logging.Filter):
    """Redacts credential-looking values from the formatted message of every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


class RedactingFormatter(logging.Formatter):
    """Formats a record, then redacts the whole text: message, traceback and stack."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


LEVEL_ENV = "REPLICAPLANE_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The log levels a service takes (logging's other names, WARN and FATAL, work too)."""

_log = logging.getLogger(__name__)


def setup(component: str, level: str | None = None) -> None:
    """Configure root logging for a service process.

    Args:
        component: name shown in each line (controller, provisioner, prober).
        level: log level name; defaults to REPLICAPLANE_LOG_LEVEL or INFO.

    Also reports an error that stops the process through the log: a bad setting or a port in use
    (errors.ValidationError, errors.StartupError) as one line naming it, anything else with its
    traceback, redacted like every other line.

    Raises:
        errors.StartupError: the level is not a level name.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(f"%(asctime)s {component} %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    sys.excepthook = _report_exit
    root.setLevel(check_level(level or os.environ.get(LEVEL_ENV, "INFO")))


def check_level(name: str) -> str:
    """The log level `name` (any case) as logging knows it.

    Raises:
        errors.StartupError: it is not a level; the message names REPLICAPLANE_LOG_LEVEL.
    """
    level = name.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise errors.StartupError(f"{LEVEL_ENV}: unknown log level {name!r}; use one of {', '.join(LEVELS)}")
    return level


def _report_exit(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
    """sys.excepthook of a service: the error that ends it, as one redacted log line for a
    user's mistake, with the traceback for anything else (a bug)."""
    if isinstance(exc, errors.ValidationError | errors.StartupError):
        _log.critical("cannot start: %s", exc)
    elif isinstance(exc, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
    else:
        _log.critical("stopped by an unexpected error", exc_info=(kind, exc, tb))
