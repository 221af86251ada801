"""Logging setup that keeps secrets (probe headers, tokens) out of every log line."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping

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


def setup(component: str, level: str | None = None) -> None:
    """Configure root logging for a service process.

    Args:
        component: name shown in each line (controller, provisioner, prober).
        level: log level name; defaults to REPLICAPLANE_LOG_LEVEL or INFO.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(f"%(asctime)s {component} %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("REPLICAPLANE_LOG_LEVEL", "INFO")).upper())
