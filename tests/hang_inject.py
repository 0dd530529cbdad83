"""`python -m tests.hang_inject <conveyor command> [args]`: a real service whose working thread
hangs on demand, for the watchdog tests (`tests/test_stalls.py`).

It runs `infra.cli` unchanged, except that one function on the service's working path blocks for
good once the file ``$CONVEYOR_TEST_HANG_DIR/hang-<pid>`` exists: the scheduler's engine thread in
`EngineCore.step`, the executor's step loop in `ModelExecutor.launch` (as a hung device
would), the gateway's event loop while routing outputs. Every other thread (the heartbeat among
them) goes on, which is what makes such a hang invisible without a watchdog.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HANG_DIR_ENV = "CONVEYOR_TEST_HANG_DIR"


def hang_flag(directory: Path, pid: int) -> Path:
    """The file whose existence makes process ``pid`` hang."""
    return directory / f"hang-{pid}"


def _hanging(fn: Callable[..., Any], flag: Path) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if flag.exists():
            print(f"hang_inject: {fn.__qualname__} hangs now", file=sys.stderr, flush=True)
            while True:  # blocked, as in a deadlock: not in Python code that could be interrupted
                time.sleep(3600)
        return fn(*args, **kwargs)

    return wrapper


def _patch(command: str, flag: Path) -> None:
    if command == "scheduler":
        from scheduler.engine_core import EngineCore

        EngineCore.step = _hanging(EngineCore.step, flag)  # type: ignore[method-assign]
    elif command == "executor":
        from executor.model_executor import ModelExecutor

        ModelExecutor.launch = _hanging(ModelExecutor.launch, flag)  # type: ignore[method-assign]
    elif command == "gateway":
        import gateway.engine.client

        gateway.engine.client.route_outputs = _hanging(gateway.engine.client.route_outputs, flag)  # type: ignore[assignment]


def main() -> int:
    from executor.threads import set_openmp_env_defaults
    from infra.cli import main as conveyor

    argv = sys.argv[1:]
    if argv[0] == "executor":
        set_openmp_env_defaults()  # as the executor's own entry does, before the patch imports torch
    _patch(argv[0], hang_flag(Path(os.environ[HANG_DIR_ENV]), os.getpid()))
    return conveyor(argv)


if __name__ == "__main__":
    sys.exit(main())
