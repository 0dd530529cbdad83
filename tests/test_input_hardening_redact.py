"""Secrets never reach a log: URL passwords and the API key, however they would get there."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.redact import RedactingFilter, redact_text, redact_url
from infra.launcher import free_port
from infra.stack import REPO, find_redis

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "url, expected",
    [
        ("redis://user:hunter2@db:6379/0", "redis://user:***@db:6379/0"),
        ("rediss://:hunter2@db.example.com:6380", "rediss://:***@db.example.com:6380"),
        ("redis://default:p%40ss@db/1?ssl_cert_reqs=none", "redis://default:***@db/1?ssl_cert_reqs=none"),
        ("redis://user:pa@ss/w#rd?x@db:6379/0", "redis://user:***@db:6379/0"),  # unencoded @ / # ? in it
        ("unix://user:hunter2@/run/redis.sock?db=0", "unix://user:***@/run/redis.sock?db=0"),
        ("redis://db:6379/0?password=hunter2&db=1", "redis://db:6379/0?password=***&db=1"),
        ("redis://db:6379/0", "redis://db:6379/0"),
        ("redis://user@db:6379", "redis://user@db:6379"),  # a user name alone is no secret
        ("http://127.0.0.1:8000/health", "http://127.0.0.1:8000/health"),
        ("http://host:8000/users/@me", "http://host:8000/users/@me"),  # "@" in a path after a port
        ("127.0.0.1:6379", "127.0.0.1:6379"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    assert "hunter2" not in redact_url(url)


def test_redact_text_finds_urls_and_secrets() -> None:
    text = "cannot reach redis://u:hunter2@db:6379/0 ('rediss://:hunter3@x'); key sk-abc123 rejected"
    clean = redact_text(text, ["sk-abc123"])
    assert clean == "cannot reach redis://u:***@db:6379/0 ('rediss://:***@x'); key *** rejected"


def test_filter_redacts_messages_arguments_and_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging, "raiseExceptions", False)  # the broken record below: no report on stderr
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter(["sk-live-123", None, ""]))
    logger = logging.getLogger("test.redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("connecting to %s with key %s", "redis://u:hunter2@db/0", "sk-live-123")
        try:
            raise ConnectionError("auth failed for redis://:hunter2@db (key sk-live-123)")
        except ConnectionError:
            logger.exception("startup failed")
        logger.info("stack", stack_info=True)
        logger.warning("a broken format %d", "not a number")  # the filter must not raise on it
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "hunter2" not in out and "sk-live-123" not in out
    assert out.count("***") >= 4 and "ConnectionError" in out and "redis://u:***@db/0" in out


@pytest.mark.stack
def test_services_install_the_filter_once(tmp_path: Path) -> None:
    code = (
        "import logging; from common.service_cli import setup_logging\n"
        "setup_logging('INFO', ['sk-1234']); setup_logging('INFO', ['sk-1234'])\n"
        "assert len(logging.getLogger().handlers[0].filters) == 1\n"
        "logging.getLogger('x').info('url %s key %s', 'redis://a:hunter2@h', 'sk-1234')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert "url redis://a:***@h key ***" in result.stderr and "hunter2" not in result.stderr


@pytest.mark.stack
def test_json_logs_are_redacted_too(tmp_path: Path) -> None:
    """``log_format="json"``: one JSON object per line, with secrets redacted from the message, the
    exception text and a structured record's fields."""
    code = (
        "import logging; from common.service_cli import setup_logging; from common.logs import log_event\n"
        "setup_logging('INFO', ['sk-1234'], 'json')\n"
        "log = logging.getLogger('x')\n"
        "log.info('url %s key %s', 'redis://a:hunter2@h', 'sk-1234')\n"
        "log_event(log, logging.INFO, 'request finished', {'request_id': 'sk-1234-x', 'url': 'redis://:hunter2@h',"
        " 'n': 5})\n"
        "try:\n    raise ConnectionError('auth failed for redis://:hunter2@db (key sk-1234)')\n"
        "except ConnectionError:\n    log.exception('startup failed')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stderr and "sk-1234" not in result.stderr, result.stderr
    first, event, failure = (json.loads(line) for line in result.stderr.splitlines())
    assert first["message"] == "url redis://a:***@h key ***" and first["level"] == "INFO" and first["logger"] == "x"
    assert event == {**event, "message": "request finished", "request_id": "***-x", "url": "redis://:***@h", "n": 5}
    assert (
        failure["message"] == "startup failed"
        and "ConnectionError: auth failed for redis://:***@db (key ***)" in failure["exception"]
    )


@pytest.mark.stack
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_gateway_logs_neither_the_redis_password_nor_the_api_key(tmp_path: Path, log_format: str) -> None:
    """The gateway with wrong Redis credentials: it says so, and stops, showing neither secret, in
    either log format (chosen here by ``CONVEYOR_LOG_FORMAT``)."""
    url, redis_proc = find_redis(tmp_path)
    try:
        host_port = url.split("://", 1)[1].split("/", 1)[0]
        bad_url = f"redis://nobody:hunter2-pw@{host_port}/0"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "infra.cli",
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--redis-url",
                bad_url,
                "--api-key",
                "sk-never-logged",
                "--log-level",
                "DEBUG",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO), "CONVEYOR_LOG_FORMAT": log_format},
        )
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-2000:]
    assert "credentials" in out and f"redis://nobody:***@{host_port}/0" in out, out[-2000:]
    assert "hunter2" not in out and "sk-never-logged" not in out, out[-2000:]
    if log_format == "json":  # every line a JSON object, the failure among them
        records = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
        assert any("credentials" in json.dumps(rec) and rec["level"] == "ERROR" for rec in records), out[-2000:]
