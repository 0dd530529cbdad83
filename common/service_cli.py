"""Flags every service shares (each also readable from a ``CONVEYOR_*`` environment variable)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from common.config import ServiceDefaults
from common.logs import DEFAULT_LOG_FORMAT, LOG_FORMATS, formatter
from common.redact import RedactingFilter
from common.redis_errors import RedisAuthFailed
from common.redis_url import URL_HELP, RedisUrlError, check_redis_url, redis_password


def env_flag(name: str) -> bool:
    """A boolean flag's default from the environment: set, and not "0", "false", "no" or "off", means on."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def service_parser(prog: str, description: str, model_help: str) -> argparse.ArgumentParser:
    """A parser with ``--redis-url``, ``--namespace``, ``--model``, ``--heartbeat-ttl-ms``, ``--stall-timeout``,
    ``--log-level``, ``--log-format``."""
    env = os.environ.get
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--redis-url", type=redis_url_arg, default=env("CONVEYOR_REDIS_URL", ServiceDefaults.redis_url), help=URL_HELP)
    p.add_argument(
        "--namespace", default=env("CONVEYOR_NAMESPACE", ServiceDefaults.namespace), help="prefix of every stream and key"
    )
    p.add_argument("--model", default=env("CONVEYOR_MODEL"), help=model_help)
    p.add_argument(
        "--heartbeat-ttl-ms", type=int, default=int(env("CONVEYOR_HEARTBEAT_TTL_MS", ServiceDefaults.heartbeat_ttl_ms))
    )
    p.add_argument(
        "--stall-timeout",
        # type= on a string default: argparse checks a value from the environment only through its type
        type=_positive_seconds,
        default=env("CONVEYOR_STALL_TIMEOUT", str(ServiceDefaults.stall_timeout_s)),
        help="seconds the service's working thread may go without turning before the process withdraws and exits "
        "(code 70) for its supervisor to restart it; on executors, keep it at least the schedulers' --result-timeout",
    )
    p.add_argument("--log-level", default=env("CONVEYOR_LOG_LEVEL", "INFO"))
    # type= as well as choices=: argparse checks a default from the environment only through its type.
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        type=_log_format,
        default=env("CONVEYOR_LOG_FORMAT", DEFAULT_LOG_FORMAT),
        help="text: one line per record; json: one JSON object per line, for log shippers",
    )
    return p


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value}")
    return seconds


def _log_format(value: str) -> str:
    if value not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_FORMATS)}, got {value!r}")
    return value


def redis_url_arg(value: str) -> str:
    """``--redis-url``'s type: the URL checked (`common.redis_url.check_redis_url`), its error in
    argparse's form; argparse would print a plain ValueError with the value, password and all."""
    try:
        return check_redis_url(value)
    except RedisUrlError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


AUTO = "auto"  # the --scheduler-id that asks for claim-based pairing (`common.protocol`, "Pairing")


def add_engine_id(p: argparse.ArgumentParser, role: str, pair: str) -> None:
    """``--scheduler-id``: a scheduler and an executor with the same id form one engine replica;
    ``auto`` pairs them by claim instead (`common.protocol`, "Pairing"), for replicas started without ids."""
    p.add_argument(
        "--scheduler-id",
        default=os.environ.get("CONVEYOR_SCHEDULER_ID", "0"),
        help=f"pairs this {role} with the {pair} of the same id (one engine replica); "
        f"'auto': a free {pair} is paired with it by claim (for replicas started from one template)",
    )


def process_id_path(role: str) -> Path:
    """Where a service records its process id for `conveyor health` (``$CONVEYOR_RUN_DIR``, else
    the temp dir): the id is made up at start (auto pairing, executors), so a probe cannot know it."""
    return Path(os.environ.get("CONVEYOR_RUN_DIR") or tempfile.gettempdir()) / f"conveyor-{role}.id"


def record_process_id(role: str, process_id: str) -> None:
    """Write this process's id to `process_id_path` (best effort: health checks are optional)."""
    try:
        process_id_path(role).write_text(process_id)
    except OSError as exc:
        logging.getLogger(__name__).warning("could not record the %s id for health checks: %s", role, exc)


def add_recovery_flags(p: argparse.ArgumentParser, recovery_help: str, resume_help: str) -> None:
    """``--recovery-timeout`` and ``--resume-window`` (see `ServiceDefaults`), read by gateways and schedulers."""
    env = os.environ.get
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=float(env("CONVEYOR_RECOVERY_TIMEOUT", ServiceDefaults.recovery_timeout_s)),
        help=recovery_help,
    )
    p.add_argument(
        "--resume-window",
        type=float,
        default=float(env("CONVEYOR_RESUME_WINDOW", ServiceDefaults.resume_window_s)),
        help=resume_help,
    )


def setup_logging(level: str, secrets: Iterable[str | None] = (), log_format: str = DEFAULT_LOG_FORMAT) -> None:
    """Log to stderr in ``log_format`` (`common.logs.LOG_FORMATS`), with URL passwords, the Redis
    password from the environment and ``secrets`` (an API key...) redacted from every record, in either format."""
    logging.basicConfig(level=level.upper())  # a stderr handler, unless the root logger has one
    try:
        secrets = [*secrets, redis_password()]  # from the environment: it appears in no URL to redact
    except RedisUrlError:
        pass  # reported where the URL is checked
    redacting = RedactingFilter(secrets)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter(log_format))
        # One filter per handler: a second call (tests) replaces the first rather than stacking.
        for old in [f for f in handler.filters if isinstance(f, RedactingFilter)]:
            handler.removeFilter(old)
        handler.addFilter(redacting)


def run_service(run: Callable[[], None], logger: logging.Logger) -> int:
    """Run a service's loop until it is stopped (Ctrl-C, or SIGTERM with `stop_on_sigterm`): exit
    code 0, or 2 with the message when Redis refused the credentials."""
    try:
        run()
    except KeyboardInterrupt:
        pass
    except RedisAuthFailed as exc:
        logger.error("%s", exc)
        return 2
    return 0


def freeze_startup_heap() -> None:
    """Exempt what a service loaded at start (the model, the tokenizer, the libraries) from the
    garbage collector, as vLLM's API server does: every per-token object a service makes is short
    lived, so a collection need only look at those, not re-walk the startup heap each time."""
    gc.collect()
    gc.freeze()


def stop_on_sigterm() -> None:
    """Make SIGTERM stop the process like Ctrl-C, so ``finally`` blocks clean up what it owns."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
