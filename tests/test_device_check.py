"""bench/device_check.sh, the one-shot GPU check, run end to end on the CPU (CPU_SMOKE=1).

No session has had a GPU yet, and a lent one gives minutes, not hours: the script, its sections,
the JSON each benchmark writes and the summary that reads it must work the first time. Only the
speed is left for the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_cpu_smoke_run_passes_every_section_and_prints_the_whole_summary(tmp_path: Path) -> None:
    env = {**os.environ, "CPU_SMOKE": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    summary = out[out.index("== summary") :]
    assert "| tests (kernels vs torch, graphs vs eager) | rc=0 1 cases OK; graphs: " in summary
    assert "| copy (read+write) |" in summary
    assert "| paged decode 3x80, dispatch |" in summary and "| prefill 1x40 |" in summary
    assert "| family kernels (windows, sinks, softcap, fused MoE) vs torch | rc=0 2 cases OK |" in summary
    assert "| window decode 3x80 w=24+sinks vs torch | max abs diff " in summary
    assert "| fused_moe E4k2 32x48 T=5 vs torch | max abs diff " in summary
    for key in ("b1_ctx40", "b2_ctx40", "b1_ctx80", "b2_ctx80"):
        assert f"| decode attention {key} | eager " in summary
    assert "| e2e (tiny llama, float32) | rc=0 (make-model rc=0) |" in summary
    assert (
        "| greedy tokens equal to transformers (information: bf16 rounds differently) | 16/16, 16/16, 16/16, 16/16 |" in summary
    )
    assert "| largest logit gap to transformers' best, teacher-forced | 0.000 (pass <= 1.0) |" in summary
    assert "| decode batch 8 | eager " in summary
    assert "unreadable" not in summary

    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert set(kernels["decode_gbps"]) == {"dispatch", "2d", "split2", "split4", "split8"}
    assert kernels["window_decode"]["max_abs_diff"] < 1e-4  # fp32
    assert set(kernels["decode_sweep"]) == {"b1_ctx40", "b2_ctx40", "b1_ctx80", "b2_ctx80"}
    assert set(kernels["fused_moe"]) == {"1", "5"} and all(m["max_abs_diff"] < 1e-4 for m in kernels["fused_moe"].values())
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert all(p["same"] == p["n"] == 16 and p["gap"] == 0.0 for p in e2e["parity"])  # fp32: exact
    assert set(e2e["decode_tok_s"]["eager"]) == {"1", "8"}
    if (ROOT / "bench" / "host_overhead.py").exists():
        assert "| host overhead (bench.host_overhead) | rc=0 " in summary
    assert len([f for f in tmp_path.iterdir() if f.is_file()]) <= 8  # the device tool returns at most 8 files
