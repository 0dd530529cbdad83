"""CPU placement (`infra.cpu_placement`): the plan, ``CONVEYOR_CPUS`` in a real process, and
`conveyor up` running its executor on CPUs of its own and everything else on the others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from infra.cpu_placement import (
    ENV_CPUS,
    Placement,
    allowed_cpus,
    apply_cpus_from_env,
    format_cpus,
    parse_cpus,
    pinned,
    plan_placement,
    tensor_parallel_size,
)
from infra.launcher import free_port, stop_all, wait_healthy

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(allowed_cpus() is None, reason="CPU affinity is Linux-only")


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-2,5, 7-8", {0, 1, 2, 5, 7, 8}), ("3-3", {3})])
def test_cpu_lists_parse_and_format_back(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "0,,1", "1.5"])
def test_a_bad_cpu_list_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="CONVEYOR_CPUS.*CPU list"):
        parse_cpus(text)


def test_plan_keeps_a_quarter_for_the_control_plane_and_splits_the_rest() -> None:
    assert plan_placement({0, 1}, 1) == Placement([{1}], {0})
    assert plan_placement(set(range(16)), 1) == Placement([set(range(4, 16))], {0, 1, 2, 3})
    # Two engines of 6 CPUs each; what an uneven split leaves goes to the control plane.
    assert plan_placement(set(range(15)), 2) == Placement([set(range(3, 9)), set(range(9, 15))], {0, 1, 2})
    assert plan_placement({2, 5, 7, 9}, 1) == Placement([{5, 7, 9}], {2})  # whatever CPUs this process has


@pytest.mark.parametrize(
    ("cpus", "engines", "per_executor"),
    [({0}, 1, 1), ({0, 1}, 2, 1), ({0, 1, 2}, 1, 4), (set(range(4)), 2, 2), (None, 1, 1), ({0, 1}, 0, 1)],
)
def test_no_plan_without_a_cpu_for_each_rank_and_one_left_over(cpus: set[int] | None, engines: int, per_executor: int) -> None:
    assert plan_placement(cpus, engines, per_executor) is None


def test_tensor_parallel_ranks_need_a_cpu_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_TENSOR_PARALLEL_SIZE", raising=False)
    assert tensor_parallel_size(["--num-blocks", "64"]) == 1
    assert tensor_parallel_size(["--tensor-parallel-size", "2"]) == 2
    assert tensor_parallel_size(["--tensor-parallel-size=4", "--num-blocks=64"]) == 4
    assert tensor_parallel_size(["--tensor-parallel-size", "x"]) == 1  # the executor's own error, at its start
    monkeypatch.setenv("CONVEYOR_TENSOR_PARALLEL_SIZE", "2")
    assert tensor_parallel_size([]) == 2
    assert plan_placement(set(range(8)), 1, tensor_parallel_size(["--tensor-parallel-size=2"])) == Placement(
        [set(range(2, 8))], {0, 1}
    )


@linux_only
def test_pinned_applies_inside_the_block_only() -> None:
    before = allowed_cpus()
    assert before is not None
    one = {min(before)}
    with pinned(one):
        assert allowed_cpus() == one
    assert allowed_cpus() == before
    with pinned(None):
        assert allowed_cpus() == before


def _cpus_of(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1].strip())
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@pytest.mark.stack
@linux_only
def test_a_service_process_applies_conveyor_cpus_before_it_starts() -> None:
    """`infra.cli` pins the process it runs; a CPU the process may not use is refused, exit 2."""
    allowed = allowed_cpus()
    assert allowed is not None
    one = format_cpus({max(allowed)})
    code = (
        "import contextlib, os\nfrom infra.cli import main\n"
        "with contextlib.suppress(SystemExit):\n    main(['health', '--help'])\nprint(sorted(os.sched_getaffinity(0)))"
    )
    env = {**os.environ, ENV_CPUS: one, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == str([max(allowed)])
    # `main` applies it: without the variable the process keeps every CPU it had.
    env.pop(ENV_CPUS)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == str(sorted(allowed))
    bad = max(allowed) + 1000
    env[ENV_CPUS] = str(bad)
    out = subprocess.run([sys.executable, "-m", "infra.cli", "health"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"CPUs {bad} are not available here" in out.stderr
    env[ENV_CPUS] = "x"
    out = subprocess.run([sys.executable, "-m", "infra.cli", "health"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a CPU list" in out.stderr
    # The same check in process.
    with pytest.raises(ValueError, match="not available here"):
        apply_cpus_from_env({ENV_CPUS: str(bad)})


def _all_children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _children(pid: int) -> dict[str, int]:
    """``{"executor"|"scheduler"|"gateway": pid}`` of the `conveyor up` process ``pid``."""
    out: dict[str, int] = {}
    for child in _all_children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for role in ("executor", "scheduler", "gateway"):
            if role.encode() in cmdline:
                out[role] = child
    return out


@pytest.mark.stack
@linux_only
@pytest.mark.skipif(plan_placement(allowed_cpus(), 1) is None, reason="needs 2 CPUs or more")
def test_conveyor_up_places_the_executor_apart_and_serves(tiny_model: Any, tmp_path: Path) -> None:
    """A real `conveyor up`: its executor runs on CPUs of its own, the scheduler, the gateway and
    its private Redis on the others, and it serves a completion."""
    plan = plan_placement(allowed_cpus(), 1)
    assert plan is not None
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("CONVEYOR_REDIS_URL", "OMP_NUM_THREADS", "CONVEYOR_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "up", "--model", str(tiny_model()), "--port", str(port), "--cpu-placement", "auto"],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", 180, [up])
        children = _children(up.pid)
        assert set(children) == {"executor", "scheduler", "gateway"}, children
        assert _cpus_of(children["executor"]) == plan.executors[0]
        assert _cpus_of(children["scheduler"]) == _cpus_of(children["gateway"]) == plan.control
        redis = [pid for pid in _all_children(up.pid) if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert all(_cpus_of(pid) == plan.control for pid in redis)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
        reply = client.completions.create(
            model=str(tiny_model()), prompt=[1, 2, 3], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        assert f"CPUs {format_cpus(plan.control)} for the control plane" in (tmp_path / "up.log").read_text(errors="replace")
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_all([up])
        log.close()


def test_placement_gives_each_process_its_cpu_list() -> None:
    plan = Placement([{2, 3}, {4}], {0, 1})
    assert plan.env(None) == {ENV_CPUS: "0-1"}
    assert plan.env(0) == {ENV_CPUS: "2-3"} and plan.env(1) == {ENV_CPUS: "4"}
    assert plan.env(2) == {ENV_CPUS: "2-3"}  # a standby executor beyond the planned engines
    assert plan.describe() == "2-3; 4"
