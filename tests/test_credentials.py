"""Redis credentials and shutdown: a wrong password stops a service with a clear message that never
shows the secret; a service waiting for an unreachable Redis still stops on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.launcher import free_port, wait_for_port
from infra.stack import REPO

pytestmark = pytest.mark.stack

SECRET = "hunter2-not-this-one"


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    workdir = tmp_path_factory.mktemp("authredis")
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--requirepass",
            "the-right-one",
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_for_port("127.0.0.1", port, 15, proc)
    yield f"redis://:{SECRET}@127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


def _run(args: list[str], redis_url: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CONVEYOR_REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "infra.cli", *args],
        env=env,
        cwd=REPO,
        stdout=open(tmp_path / "out.log", "wb"),
        stderr=subprocess.STDOUT,
    )


@pytest.mark.parametrize("args", [["scheduler"], ["gateway", "--port", "0"]])
def test_wrong_password_stops_with_a_clear_message(redis_with_password: str, tmp_path: Path, args: list[str]) -> None:
    proc = _run(args, redis_with_password, tmp_path)
    assert proc.wait(timeout=60) == 2  # as docs/redis.md promises: a configuration error, not a crash
    log = (tmp_path / "out.log").read_text()
    assert "rejected the credentials" in log, log[-2000:]
    assert SECRET not in log
    errors = [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1 and "rejected the credentials" in errors[0], log[-2000:]


@pytest.mark.parametrize("args", [["scheduler"], ["gateway", "--port", "0"]])
def test_sigterm_stops_a_service_waiting_for_redis(tmp_path: Path, args: list[str]) -> None:
    proc = _run(args, f"redis://127.0.0.1:{free_port()}/0", tmp_path)  # nothing listens there
    time.sleep(4)
    assert proc.poll() is None, "it should keep retrying, not exit"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) is not None
