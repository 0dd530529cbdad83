"""The `conveyor` command: one subcommand per deployable process or tool.

Each subcommand lives in its own module as ``main(argv)``; imports are lazy so that, e.g., the
executor runs on a machine without the gateway's packages.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("executor.make_model", "write a small random checkpoint in Hugging Face format"),
    "gateway": ("gateway.http.server", "run the OpenAI-compatible HTTP gateway"),
    "scheduler": ("scheduler.cli", "run the scheduler service"),
    "executor": ("executor.service", "run the executor service"),
    "up": ("infra.launcher", "start Redis, executor, scheduler and gateway together"),
    "bench": ("bench.cli", "run a benchmark (offline, serve, prefix-overhead)"),
    "health": ("infra.health", "exit 0 if this host's gateway, scheduler or executor is live (health checks)"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``conveyor <command> [args...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: conveyor <command> [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<12} {help_text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from infra.cpu_placement import apply_cpus_from_env

    try:  # before the service imports torch: its thread count follows the CPUs it may use
        apply_cpus_from_env()
    except ValueError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
