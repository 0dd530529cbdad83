"""Log formats of every service (``--log-format``, `common.service_cli.setup_logging`) and
structured records.

``text`` is one human-readable line per record; ``json`` is one JSON object per line (time,
level, logger, message, and the exception text, if any), which log shippers ingest without a
parser. A *structured* record (`log_event`) carries fields beside its message: in text its
message ends with them as ``key=value`` pairs, in JSON they are keys of the object.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

LOG_FORMATS = ("text", "json")
DEFAULT_LOG_FORMAT = "text"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The `logging.LogRecord` attribute of a structured record: ``(event, fields)``. `RedactingFilter`
# redacts the fields' strings too, so a secret cannot reach a JSON log through them.
STRUCTURED = "conveyor_structured"
# Keys every JSON line has; a field of the same name cannot replace them.
_BASE_KEYS = ("time", "level", "logger", "message")


def log_event(logger: logging.Logger, level: int, event: str, fields: dict[str, Any]) -> None:
    """Log ``event`` with ``fields`` (str, int, float, bool or None values): ``event: k=v k=v`` as
    text, ``{"message": event, "k": v, ...}`` as JSON."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s: %s", event, logfmt(fields), extra={STRUCTURED: (event, fields)})


def logfmt(fields: dict[str, Any]) -> str:
    """``key=value`` pairs: a value with a space, a quote or ``=`` (or empty) is JSON-quoted, None is ``null``."""
    parts = []
    for key, value in fields.items():
        if value is None:
            text = "null"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, float):
            text = f"{value:.4f}"
        else:
            text = str(value)
            if not text or any(c in text for c in ' "=\\') or not text.isprintable():
                text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, a structured record's fields, and ``exception`` / ``stack`` when present.

    Formats what the handler's filters left: with `RedactingFilter` on the handler (as
    `setup_logging` puts it), every string in the object is already redacted.
    """

    def format(self, record: logging.LogRecord) -> str:
        structured = getattr(record, STRUCTURED, None)
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": structured[0] if structured else record.getMessage(),
        }
        if structured:
            out.update((k, v) for k, v in structured[1].items() if k not in _BASE_KEYS)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: an unexpected value type must not lose the record.
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``log_format`` (one of `LOG_FORMATS`)."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
