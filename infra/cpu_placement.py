"""CPU placement for services that share one host: executors on CPUs of their own, the control
plane (gateways, schedulers, a Redis the launcher started) on the rest.

Why: an executor that shares its CPUs with the control plane is preempted mid-step and resumes
with cold caches. Pinning it apart serves more tokens/s with a model whose executor needs one
thread, at a higher inter-token latency (the gateway, with fewer CPUs, merges more steps per
event), and costs a model whose executor would run more threads than it is left (docs/performance.md,
"CPU placement", has the numbers). So it is off by default: a trade for hosts where the control
plane's load would otherwise preempt the executor. vLLM's CPU backend binds its OpenMP threads to
cores for the same reason.

Every service process applies ``CONVEYOR_CPUS`` (a Linux CPU list such as ``0-3,6``) first
thing (`apply_cpus_from_env`, from `infra.cli`), before torch reads its affinity mask to choose
its thread count. The launchers (`conveyor up`, `infra.stack.Stack`) plan the split with
`plan_placement` and set the variable per process; a deployment can set it per service (or use
its orchestrator's cpusets). Linux only: elsewhere nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

ENV_CPUS = "CONVEYOR_CPUS"
# The control plane gets a quarter of the host's CPUs, and at least one: a middle between the tiny
# model, whose gateway, scheduler and Redis used 3.1 CPU-s of one run against its executor's 2.2
# on the development VM, and a large model, whose executor wants nearly every CPU there is.
CONTROL_SHARE = 4


def parse_cpus(text: str) -> set[int]:
    """The CPUs of a Linux CPU list (``0-3,6``); ``ValueError`` if it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"{ENV_CPUS}: {text!r} is not a CPU list such as 0-3,6") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{ENV_CPUS}: {text!r} is not a CPU list such as 0-3,6")
        cpus.update(range(lo, hi + 1))
    return cpus


def format_cpus(cpus: set[int]) -> str:
    """``cpus`` as a Linux CPU list (the inverse of `parse_cpus`; "" for none)."""
    if not cpus:
        return ""
    out: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(out)


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on, or None where the OS cannot say (not Linux)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return set(getaffinity(0)) if getaffinity is not None else None


def apply_cpus_from_env(environ: Mapping[str, str] | None = None) -> set[int] | None:
    """Pin this process to ``CONVEYOR_CPUS`` (None when unset or empty); a CPU it may not use is a
    ``ValueError`` naming the ones it may. Call it before threads start or torch is imported."""
    text = (os.environ if environ is None else environ).get(ENV_CPUS, "").strip()
    if not text:
        return None
    cpus = parse_cpus(text)
    allowed = allowed_cpus()
    if allowed is None:
        return None  # nothing to pin on this OS
    if not cpus <= allowed:
        raise ValueError(
            f"{ENV_CPUS}={text}: CPUs {format_cpus(cpus - allowed)} are not available here "
            f"(this process may use {format_cpus(allowed)})"
        )
    os.sched_setaffinity(0, cpus)
    return cpus


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the calling thread (and the threads it starts) on ``cpus`` inside the block, then on
    what it had before; None pins nothing."""
    before = allowed_cpus()
    if cpus is None or before is None:
        yield
        return
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(slots=True)
class Placement:
    """Which CPUs each executor (engine ``i``: ``executors[i]``) and the control plane run on."""

    executors: list[set[int]]
    control: set[int]

    def describe(self) -> str:
        """The executors' CPU lists, one per engine, for a log line."""
        return "; ".join(format_cpus(cpus) for cpus in self.executors)

    def env(self, engine: int | None) -> dict[str, str]:
        """The environment that pins one process: engine ``engine``'s executor (a standby beyond
        the planned engines shares one's CPUs), or (None) the control plane."""
        return {ENV_CPUS: format_cpus(self.control if engine is None else self.executors[engine % len(self.executors)])}


def plan_placement(allowed: set[int] | None, num_engines: int, cpus_per_executor: int = 1) -> Placement | None:
    """Split ``allowed`` CPUs: the lowest quarter (at least one) to the control plane, the rest
    shared equally among ``num_engines`` executors (each needs ``cpus_per_executor``, one per
    tensor-parallel rank). None when there are too few CPUs for that, or the OS cannot pin."""
    if allowed is None or num_engines < 1:
        return None
    ordered = sorted(allowed)
    num_control = max(1, len(ordered) // CONTROL_SHARE)
    share = (len(ordered) - num_control) // num_engines
    if share < max(1, cpus_per_executor):
        return None
    control, rest = ordered[:num_control], ordered[num_control:]
    executors = [set(rest[i * share : (i + 1) * share]) for i in range(num_engines)]
    control += rest[num_engines * share :]  # what an uneven split leaves over
    return Placement(executors, set(control))


def tensor_parallel_size(executor_args: Sequence[str]) -> int:
    """The ranks of an executor started with ``executor_args``, as the executor reads them (its own
    parser: the flag, its environment variable and default), i.e. the CPUs it needs at least."""
    from executor.service import build_parser  # imports no torch

    try:
        args, _ = build_parser().parse_known_args(list(executor_args))
    except SystemExit:  # a bad value: the executor itself rejects it, with its own message
        return 1
    return max(1, args.tensor_parallel_size)
