"""CPU threads: how many intra-op threads torch runs, and how long idle ones spin.

torch's CPU kernels, oneDNN's linears included, run on an OpenMP team (the pip wheels ship GNU
libgomp). Two settings decide how the engine fares when other processes share the cores:

* **How idle OpenMP threads wait.** libgomp's default (``OMP_WAIT_POLICY`` and
  ``GOMP_SPINCOUNT`` unset) spins 300,000 ``pause`` iterations before sleeping; on current x86
  cores that is tens of milliseconds, longer than the gaps between a step's ops and between
  steps, so a worker thread never sleeps and every thread of the team holds a core. On an idle machine that costs nothing. On a
  busy one the spinners take CPU time from the threads they wait for (and from everything else),
  a team barrier waits for a preempted member for up to a scheduler slice, and a thread that
  never sleeps loses the wake-up preference the kernel gives to sleepers. The engine runs many
  short parallel regions per step, so it pays this per region. libgomp reads the variables once,
  when it is loaded (``import torch``): `set_openmp_env_defaults` must run before that, which is
  why the entry points call it first thing.
* **How many threads.** `configure_cpu_threads` applies an explicit count (``num_threads``,
  ``CONVEYOR_NUM_THREADS``), else ``OMP_NUM_THREADS``, else the CPUs this process may use (its
  affinity mask, capped by a cgroup CPU quota: a container limited to 1.5 CPUs gets 2 threads,
  not one per host core).

Measured numbers and commands: docs/performance.md, "CPU threads".
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_NUM_THREADS = "CONVEYOR_NUM_THREADS"
# Each of these means someone chose how idle OpenMP threads wait; `set_openmp_env_defaults`
# leaves the environment alone when any is set (GOMP_SPINCOUNT would override OMP_WAIT_POLICY).
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# A spin long enough to cover the gaps between one step's ops (Python between kernels), so an idle
# machine keeps its speed, and short enough to stop burning a core right after. Passive waiting
# (OMP_WAIT_POLICY=PASSIVE) is as robust under load but slower when idle (docs/performance.md).
DEFAULT_GOMP_SPINCOUNT = "1000"
_OPENMP_LIBS = ("libgomp", "libiomp", "libomp.so")

_warned_spinning = False


def openmp_started() -> bool:
    """Whether an OpenMP runtime is already loaded into this process (so it has read its env).

    Reads ``/proc/self/maps`` where there is one; elsewhere, whether torch has been imported.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "torch" in sys.modules
    return any(lib in maps for lib in _OPENMP_LIBS)


def set_openmp_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Make idle OpenMP threads sleep after a short spin, unless the environment already says how.

    Sets ``GOMP_SPINCOUNT`` to `DEFAULT_GOMP_SPINCOUNT` when neither it nor ``OMP_WAIT_POLICY``
    is set. Returns the variables it set: empty when the user chose already, or when this
    process's OpenMP runtime has started (the setting would not take effect here, so it is not
    set). Child processes inherit what it sets.
    Call it before ``import torch``: first thing in an entry point.
    """
    env = os.environ if environ is None else environ
    if any(var in env for var in WAIT_POLICY_VARS):
        return {}
    if openmp_started():  # too late here; `configure_cpu_threads` warns about the consequence
        logger.info("OpenMP already started: GOMP_SPINCOUNT not set (it would not take effect in this process)")
        return {}
    env["GOMP_SPINCOUNT"] = DEFAULT_GOMP_SPINCOUNT
    return {"GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}


def cgroup_cpu_limit(
    root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup"
) -> float | None:
    """CPUs this process's cgroup may use (quota / period), or None when unlimited or unknown.

    cgroup v2: ``cpu.max`` of the process's own cgroup (then of the root, as a container shows
    it); v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.
    """
    base = Path(root)
    candidates: list[Path] = []
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            hierarchy, _, path = line.partition("::")
            if hierarchy == "0" and path:
                candidates.append(base / path.lstrip("/") / "cpu.max")
    except OSError:
        pass
    candidates.append(base / "cpu.max")
    for cpu_max in candidates:
        try:
            quota, period = cpu_max.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else _ratio(quota, period)
    for v1 in (base / "cpu", base / "cpu,cpuacct"):
        try:
            quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
            period = (v1 / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            continue
        return None if quota.startswith("-") else _ratio(quota, period)
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1 or (isinstance(value, float) and n != value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


def resolve_num_threads(num_threads: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The intra-op thread count to use: ``num_threads`` if given, else ``CONVEYOR_NUM_THREADS``,
    else ``OMP_NUM_THREADS`` (its first level, as in ``4,2``), else `usable_cpus`. An empty value
    or ``auto`` in either variable counts as unset; anything else that is not a positive integer
    is a ``ValueError``."""
    env = os.environ if environ is None else environ
    if num_threads is not None:
        return _positive_int("num_threads", num_threads)
    for var in (ENV_NUM_THREADS, "OMP_NUM_THREADS"):
        value = env.get(var, "").strip()
        if var == "OMP_NUM_THREADS":
            value = value.split(",")[0].strip()
        if value and value.lower() != "auto":
            return _positive_int(var, value)
    return usable_cpus()


def configure_cpu_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op thread count for this process and return it (see `resolve_num_threads`).

    ``None`` is automatic: ``CONVEYOR_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the usable
    CPUs. Idempotent (the executor calls it as it starts). Warns once per process when torch's
    OpenMP threads spin the libgomp default, i.e. `set_openmp_env_defaults` did not run before
    torch was imported and no wait policy was given.
    """
    global _warned_spinning
    import torch

    n = resolve_num_threads(num_threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if n > 1 and not any(var in os.environ for var in WAIT_POLICY_VARS) and not _warned_spinning:
        _warned_spinning = True
        logger.warning(
            "%d torch threads with libgomp's default spin-wait: throughput collapses when other processes share "
            "the cores; set GOMP_SPINCOUNT=%s (or OMP_WAIT_POLICY=PASSIVE) before starting Python "
            "(docs/performance.md, 'CPU threads')",
            n,
            DEFAULT_GOMP_SPINCOUNT,
        )
    return n
