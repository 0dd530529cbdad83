"""`conveyor scheduler`: flags and entry point of the scheduler service."""

from __future__ import annotations

import argparse
import os
import socket

from common.config import SCHEDULING_POLICIES, SchedulerConfig, ServiceDefaults
from common.service_cli import (
    add_engine_id,
    add_recovery_flags,
    freeze_startup_heap,
    run_service,
    service_parser,
    setup_logging,
    stop_on_sigterm,
)
from scheduler.service import SchedulerService, SchedulerServiceConfig, logger


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (anything else is an error)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = service_parser(
        "conveyor scheduler", "Run the scheduler service.", "unused (the executor reports the model); accepted for symmetry"
    )
    add_engine_id(p, "scheduler", "executor")
    p.add_argument("--max-num-seqs", type=int, default=int(env("CONVEYOR_MAX_NUM_SEQS", SchedulerConfig().max_num_seqs)))
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(env("CONVEYOR_MAX_NUM_BATCHED_TOKENS", SchedulerConfig().max_num_batched_tokens)),
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=env_flag("CONVEYOR_ENABLE_PREFIX_CACHING", SchedulerConfig().enable_prefix_caching),
        help="reuse the KV blocks of prompt prefixes seen before (default: on)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=env_flag("CONVEYOR_ASYNC_SCHEDULING", SchedulerConfig().async_scheduling),
        help="schedule and send the next step while the executor runs the current one (default: on)",
    )
    p.add_argument(
        "--steps-in-flight",
        type=int,
        default=int(env("CONVEYOR_STEPS_IN_FLIGHT", SchedulerConfig().steps_in_flight)),
        help="with async scheduling, steps sent ahead of their results (default 2: one ahead); more hide a longer "
        "round trip to the executor, e.g. a Redis a network hop away",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=env("CONVEYOR_SCHEDULING_POLICY", SchedulerConfig().scheduling_policy),
        help="fcfs (default), or priority: requests' priority field (lower first) orders admission and "
        "preemption, as vLLM's --scheduling-policy priority",
    )
    p.add_argument(
        "--result-timeout",
        type=float,
        default=float(env("CONVEYOR_RESULT_TIMEOUT", ServiceDefaults.result_timeout_s)),
        help="seconds to wait for one step's result before declaring the executor lost",
    )
    add_recovery_flags(
        p,
        "seconds to keep requests without an executor before failing them",
        "seconds a stream whose gateway died keeps generating, waiting to be resumed",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, log_format=args.log_format)
    stop_on_sigterm()
    config = SchedulerServiceConfig(
        redis_url=args.redis_url,
        namespace=args.namespace,
        scheduler_id=args.scheduler_id,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        steps_in_flight=args.steps_in_flight,
        scheduling_policy=args.scheduling_policy,
        result_timeout_s=args.result_timeout,
        stall_timeout_s=args.stall_timeout,
        recovery_timeout_s=args.recovery_timeout,
        resume_window_s=args.resume_window,
        heartbeat_ttl_ms=args.heartbeat_ttl_ms,
    )
    try:
        config.scheduler_config()
    except ValueError as exc:
        parser.error(str(exc))
    logger.info("scheduler %s (namespace %r, host %s)", config.scheduler_id, config.namespace, socket.gethostname())
    service = SchedulerService(config)
    freeze_startup_heap()
    return run_service(service.run, logger)
