"""`conveyor scheduler`: flags and entry point of the scheduler service."""

from __future__ import annotations

import argparse
import os
import socket

from common.config import SchedulerConfig, ServiceDefaults
from common.service_cli import service_parser, setup_logging, stop_on_sigterm
from common.transport import RedisAuthFailed
from scheduler.service import SchedulerService, SchedulerServiceConfig, logger


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = service_parser("conveyor scheduler", "Run the scheduler service.",
                       "unused (the executor reports the model); accepted for symmetry")
    p.add_argument("--scheduler-id", default=env("CONVEYOR_SCHEDULER_ID", "0"),
                   help="pairs this scheduler with the executor of the same id (one engine replica)")
    p.add_argument("--max-num-seqs", type=int, default=int(env("CONVEYOR_MAX_NUM_SEQS", SchedulerConfig().max_num_seqs)))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=int(env("CONVEYOR_MAX_NUM_BATCHED_TOKENS", SchedulerConfig().max_num_batched_tokens)))
    p.add_argument("--result-timeout", type=float, default=float(env("CONVEYOR_RESULT_TIMEOUT", ServiceDefaults.result_timeout_s)),
                   help="seconds to wait for one step's result before declaring the executor lost")
    p.add_argument("--recovery-timeout", type=float,
                   default=float(env("CONVEYOR_RECOVERY_TIMEOUT", ServiceDefaults.recovery_timeout_s)),
                   help="seconds to keep requests without an executor before failing them")
    p.add_argument("--resume-window", type=float, default=float(env("CONVEYOR_RESUME_WINDOW", ServiceDefaults.resume_window_s)),
                   help="seconds a stream whose gateway died keeps generating, waiting to be resumed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    stop_on_sigterm()
    config = SchedulerServiceConfig(
        redis_url=args.redis_url, namespace=args.namespace, scheduler_id=args.scheduler_id,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        result_timeout_s=args.result_timeout, recovery_timeout_s=args.recovery_timeout,
        resume_window_s=args.resume_window, heartbeat_ttl_ms=args.heartbeat_ttl_ms,
    )
    logger.info("scheduler %s (namespace %r, host %s)", config.scheduler_id, config.namespace, socket.gethostname())
    try:
        SchedulerService(config).run()
    except KeyboardInterrupt:
        pass
    except RedisAuthFailed as exc:
        logger.error("%s", exc)
        return 2
    return 0
