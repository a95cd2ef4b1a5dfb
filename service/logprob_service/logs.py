"""Log setup with the stdlib: plain text lines, or one JSON object per line (``--log-format json``).

A record may carry structured fields (``log.info("...", extra={"fields": {...}})``, as
``accounting`` does for every request): a text line appends them as ``key=value``, a JSON line
holds them as keys of its object, beside ``time``, ``level``, ``logger`` and ``message``.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, Literal

LogFormat = Literal["text", "json"]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, "fields", None) or {}


def _text_value(value: Any) -> str:
    text = str(value)
    # Quoted only when needed, so key=value pairs split on spaces stay unambiguous.
    return json.dumps(text) if not text or any(c in text for c in ' "=') else text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # before any traceback is appended
        line = super().formatMessage(record)
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: LogFormat) -> None:
    """Every logger of the process (grpc's and transformers' too) writes to stderr in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


# A request id longer than this is cut where a log line or a message shows it (a caller may send
# one of 60 KB).
SHOWN_ID_CHARS = 128


def shown_id(request_id: str) -> str:
    """``request_id`` as a log line shows it: past ``SHOWN_ID_CHARS``, cut and its length said."""
    if len(request_id) <= SHOWN_ID_CHARS:
        return request_id
    return f"{request_id[:SHOWN_ID_CHARS]}...({len(request_id)} characters)"
