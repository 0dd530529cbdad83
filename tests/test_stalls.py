"""Watchdogs: a service whose working thread hangs while its heartbeat thread goes on beating.

The processes are real (two engines, two gateways, tiny checkpoint) and run through
`tests.hang_inject`, which makes one of them hang on demand: the scheduler's engine thread, the
executor's step loop (a hung device) or the gateway's event loop. Without a watchdog every peer
would see that process alive and its requests would wait forever. With one (``--stall-timeout``,
3 s here) the process takes its keys out of Redis, logs where it is stuck and exits with
`STALLED_EXIT_CODE`; its work is recovered as after a crash, and every stream ends as in the run
without a fault.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from common.watchdog import STALLED_EXIT_CODE
from infra.stack import Stack
from tests.hang_inject import HANG_DIR_ENV, hang_flag
from tests.test_chaos import NUM_STREAMS, _busiest_engine, _check, reference_run, run_load

pytestmark = [pytest.mark.stack, pytest.mark.slow]

STALL_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("stalls"))
    with pytest.MonkeyPatch.context() as env:  # read by every process the stack spawns
        env.setenv(HANG_DIR_ENV, str(workdir))
        env.setenv("CONVEYOR_STALL_TIMEOUT", str(STALL_TIMEOUT_S))
        s = Stack(
            tiny_model(),
            workdir,
            gateways=2,
            engines=2,
            executor_args=("--num-blocks", "256"),
            scheduler_args=("--recovery-timeout", "60"),
            module="tests.hang_inject",
        )
        s.start()
        yield s
        s.stop()


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[str]:
    return reference_run(stack)


def _hang_and_restart(stack: Stack, kind: str, index: int) -> None:
    """Make process ``<kind><index>`` hang, wait for its watchdog to end it, check how, start a new one."""
    name = f"{kind}{index}"
    proc = stack.procs[name]
    flag = hang_flag(stack.workdir, proc.pid)
    flag.touch()
    started = time.monotonic()
    try:
        code = proc.wait(timeout=STALL_TIMEOUT_S + 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{name} hung for {STALL_TIMEOUT_S + 20:.0f} s and its watchdog never ended it\n{stack.logs(20)}")
    finally:
        flag.unlink()
    took = time.monotonic() - started
    log = (stack.workdir / f"{name}.log").read_text(errors="replace")
    assert code == STALLED_EXIT_CODE, f"{name} exited with {code}\n{log[-3000:]}"
    assert "has not turned for" in log and "time.sleep(3600)" in log, log[-3000:]  # the stuck thread's stack
    # (the last tick may precede the hang by one bounded wait of the loop: up to a second)
    assert took >= STALL_TIMEOUT_S - 1.0, f"{name} ended {took:.1f} s after it hung"
    {"scheduler": stack.spawn_scheduler, "executor": stack.spawn_executor, "gateway": stack.spawn_gateway}[kind](index)


@pytest.mark.parametrize("role", ["scheduler", "executor", "gateway"])
def test_stuck_thread_ends_its_process_and_its_work_is_recovered(stack: Stack, reference: list[str], role: str) -> None:
    def fault() -> None:
        _hang_and_restart(stack, role, 0 if role == "gateway" else int(_busiest_engine(stack)))

    results = run_load(stack, fault, after_events=NUM_STREAMS * 4)
    _check(stack, results, reference, f"{role} stuck (watchdog)")
    assert max(r.max_gap_s for r in results) >= STALL_TIMEOUT_S or any(r.resumes for r in results), (
        "no stream waited for the stuck process: the fault missed every request"
    )


def test_frozen_process_is_not_a_stall(stack: Stack) -> None:
    """A whole process frozen for longer than the stall timeout (SIGSTOP, a paused VM) stopped its
    heartbeat thread too: its peers saw it gone and recovered. Once it runs again it goes on serving."""
    proc = stack.procs["executor0"]
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(STALL_TIMEOUT_S * 2)
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(STALL_TIMEOUT_S)
    assert proc.poll() is None, f"executor0 exited with {proc.returncode} after a freeze"
    results = run_load(stack)
    assert all(not r.errors and r.text for r in results), [r.errors for r in results]


def test_stuck_executor_without_its_watchdog_fails_requests_after_the_recovery_timeout(
    tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: with the executor's watchdog off, its heartbeat goes on and the scheduler
    rebinds it after every result timeout. The recovery clock runs until a bound executor answers
    a step, so the requests fail with a clear error instead of waiting forever."""
    monkeypatch.setenv(HANG_DIR_ENV, str(tmp_path))
    s = Stack(
        tiny_model(),
        tmp_path,
        executor_args=("--stall-timeout", "1000"),
        scheduler_args=("--result-timeout", "2", "--recovery-timeout", "6"),
        module="tests.hang_inject",
    ).start()
    try:
        hang_flag(tmp_path, s.procs["executor0"].pid).touch()
        client = openai.OpenAI(base_url=f"{s.urls[0]}/v1", api_key="x", max_retries=0, timeout=60)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="", prompt="hi", max_tokens=8)
        assert "recovery timeout" in str(failed.value), failed.value
        assert 6 <= time.monotonic() - started < 30
        assert "sent no result" in (tmp_path / "scheduler0.log").read_text()  # rebound at least once
    finally:
        s.stop()
