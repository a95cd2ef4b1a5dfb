"""Text and JSON log lines carry a record's structured fields; JSON lines are one object each."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
from logprob_service.logs import JsonFormatter, TextFormatter, configure_logging

FIELDS = {"rpc": "ScoreTokens", "request_id": "r-1", "status": "INVALID_ARGUMENT", "error": 'bad id "7"', "tokens": 12}


def record(message: str, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("logprob_service.requests", logging.WARNING, __file__, 1, message, (), exc_info)


def with_fields(rec: logging.LogRecord) -> logging.LogRecord:
    rec.fields = dict(FIELDS)
    return rec


def test_text_line_appends_fields_quoting_only_what_needs_it():
    line = TextFormatter().format(with_fields(record("failed")))
    assert line.endswith(
        "logprob_service.requests: failed rpc=ScoreTokens request_id=r-1 status=INVALID_ARGUMENT "
        'error="bad id \\"7\\"" tokens=12'
    )
    assert TextFormatter().format(record("plain")).endswith("logprob_service.requests: plain")


def test_json_line_holds_fields_and_the_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = with_fields(record("failed", exc_info=sys.exc_info()))
    entry = json.loads(JsonFormatter().format(rec))
    assert {k: entry[k] for k in FIELDS} == FIELDS
    assert (entry["level"], entry["logger"], entry["message"]) == ("WARNING", "logprob_service.requests", "failed")
    assert entry["time"].endswith("+00:00") and "ValueError: boom" in entry["exception"]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_configure_logging_routes_every_logger(monkeypatch, log_format):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO", log_format)
        logging.getLogger("grpc").info("from a library", extra={"fields": {"k": 1}})
        logging.getLogger("logprob_service").debug("below the level")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    if log_format == "json":
        assert json.loads(lines[0])["k"] == 1
    else:
        assert lines[0].endswith("grpc: from a library k=1")
