"""CPU thread policy (`executor.threads`): thread-count resolution, cgroup quotas, and the OpenMP
wait policy reaching libgomp (read back from libgomp's own OMP_DISPLAY_ENV report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from executor import threads
from executor.threads import (
    DEFAULT_GOMP_SPINCOUNT,
    cgroup_cpu_limit,
    configure_cpu_threads,
    resolve_num_threads,
    set_openmp_env_defaults,
    usable_cpus,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "CONVEYOR_NUM_THREADS", "OMP_DISPLAY_ENV")


def test_explicit_count_wins_over_environment():
    env = {"CONVEYOR_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert resolve_num_threads(1, env) == 1
    assert resolve_num_threads(None, env) == 3
    assert resolve_num_threads(None, {"OMP_NUM_THREADS": "5"}) == 5
    assert resolve_num_threads(None, {"CONVEYOR_NUM_THREADS": "auto", "OMP_NUM_THREADS": "4"}) == 4
    assert resolve_num_threads(None, {"OMP_NUM_THREADS": "3,1"}) == 3  # nested levels: the outer one


def test_auto_is_the_usable_cpus():
    assert resolve_num_threads(None, {}) == usable_cpus()
    assert resolve_num_threads(None, {"CONVEYOR_NUM_THREADS": ""}) == usable_cpus()
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "two"])
def test_bad_explicit_count_is_refused(bad):
    with pytest.raises(ValueError, match="num_threads"):
        resolve_num_threads(bad)


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many"])
def test_bad_environment_count_names_the_variable(value):
    with pytest.raises(ValueError, match="CONVEYOR_NUM_THREADS"):
        resolve_num_threads(None, {"CONVEYOR_NUM_THREADS": value})


def test_cgroup_v2_quota_of_the_process_own_group(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")  # the root group: unlimited
    (tmp_path / "svc" / "executor").mkdir(parents=True)
    (tmp_path / "svc" / "executor" / "cpu.max").write_text("150000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/svc/executor\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 1.5
    proc.write_text("0::/\n")
    assert cgroup_cpu_limit(tmp_path, proc) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    missing = tmp_path / "no-proc-cgroup"
    assert cgroup_cpu_limit(tmp_path, missing) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path, missing) is None
    assert cgroup_cpu_limit(tmp_path / "nothing-here", missing) is None


def test_quota_caps_the_automatic_count(monkeypatch):
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda *a: 0.5)
    assert usable_cpus() == 1
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda *a: 1000.0)
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_configure_sets_torch_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("CONVEYOR_NUM_THREADS", raising=False)
    try:
        assert configure_cpu_threads(1) == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("CONVEYOR_NUM_THREADS", "2")
        assert configure_cpu_threads() == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_user_wait_policy_is_left_alone():
    for env in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}):
        before = dict(env)
        assert set_openmp_env_defaults(env) == {}
        assert env == before


def test_too_late_once_openmp_runs():
    """torch (and so libgomp) is loaded in this process: the variable would not take effect."""
    assert threads.openmp_started()
    env: dict[str, str] = {}
    assert set_openmp_env_defaults(env) == {}
    assert env == {}


def _libgomp_report(code: str, **env: str) -> tuple[dict, str]:
    """Run ``code`` in a fresh interpreter with libgomp's ICV report on; return its JSON line and the report."""
    clean = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    clean.update(OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=clean, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_default_reaches_libgomp_when_set_before_torch():
    out, report = _libgomp_report("""
        import json, os
        from executor.threads import openmp_started, set_openmp_env_defaults
        before = openmp_started()
        applied = set_openmp_env_defaults()
        import torch
        print(json.dumps(dict(before=before, after=openmp_started(), applied=applied)))
    """)
    assert out == {"before": False, "after": True, "applied": {"GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}}
    assert f"GOMP_SPINCOUNT = '{DEFAULT_GOMP_SPINCOUNT}'" in report


def test_after_torch_libgomp_keeps_its_default():
    out, report = _libgomp_report("""
        import json, os, torch
        from executor.threads import set_openmp_env_defaults
        print(json.dumps(dict(applied=set_openmp_env_defaults(), env=os.environ.get("GOMP_SPINCOUNT"))))
    """)
    assert out == {"applied": {}, "env": None}
    assert "GOMP_SPINCOUNT = '300000'" in report  # libgomp's own default: the long spin


def test_users_policy_reaches_libgomp_untouched():
    out, report = _libgomp_report(
        """
        import json
        from executor.threads import set_openmp_env_defaults
        applied = set_openmp_env_defaults()
        import torch
        print(json.dumps(dict(applied=applied)))
    """,
        OMP_WAIT_POLICY="ACTIVE",
    )
    assert out == {"applied": {}}
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in report
    assert f"GOMP_SPINCOUNT = '{DEFAULT_GOMP_SPINCOUNT}'" not in report
