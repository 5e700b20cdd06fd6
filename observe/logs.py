"""structlog set up once per process: JSON lines to the run directory, key=value on the console.

The launcher calls `setup_logging(run_dir, "launcher")`; every actor calls
`setup_actor_logging(name, ctx)` in its constructor with the run's config.context.RunContext, so its
lines land in <run_dir>/logs/<name>.jsonl at the run's level (its console is Ray's worker log, so off).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import structlog

from config import layout

_configured: dict[str, object] = {}


class _Tee:
    """Sends each rendered event to the JSON file and (optionally) the console renderer."""

    def __init__(self, path: Path | None, console: bool):
        self.file = open(path, "a", buffering=1) if path else None
        self.console = console
        self.json = structlog.processors.JSONRenderer()
        self.pretty = structlog.dev.ConsoleRenderer(colors=False)

    def __call__(self, logger, method, event_dict):
        if self.file is not None:
            self.file.write(self.json(logger, method, dict(event_dict)) + "\n")
        if self.console:
            return self.pretty(logger, method, event_dict)
        raise structlog.DropEvent


def setup_logging(run_dir: str | Path | None = None, name: str = "launcher", *, level: str = "info",
                  console: bool = True) -> structlog.BoundLogger:
    path = None
    if run_dir is not None:
        logs = layout.logs_dir(run_dir)
        logs.mkdir(parents=True, exist_ok=True)
        path = layout.log_file(run_dir, name)
    key = f"{path}:{console}:{level}"
    if _configured.get("key") != key:
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                _Tee(path, console),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=False,
        )
        _configured["key"] = key
    return structlog.get_logger(actor=name)


def get_logger(name: str) -> structlog.BoundLogger:
    return structlog.get_logger(actor=name)


def setup_actor_logging(name: str, ctx=None) -> structlog.BoundLogger:
    """An actor's JSON log at <ctx.run_dir>/logs/<name>.jsonl at ctx.log_level, console off (Ray's worker
    logs hold stderr). Without a run directory (a plain class in a test) a logger that writes nowhere
    new. `ctx` None (launch.serve, outside a run): the directory in $ARL_RUN_DIR, if any."""
    run_dir = ctx.run_dir if ctx is not None else os.environ.get("ARL_RUN_DIR", "")
    if not run_dir:
        return get_logger(name)
    level = ctx.log_level if ctx is not None else "info"
    return setup_logging(run_dir, name.replace(":", "_").replace("/", "_"), level=level, console=False)


def quiet_cpu_host() -> None:
    """On a host without NVIDIA devices, tell DeepSpeed so: its accelerator auto-detection otherwise
    prints a WARNING line on import (transformers imports it when accelerate is installed), which
    breaks the launcher's one-line errors. Only this process's environment; GPU actors are unaffected
    (DS_* is not forwarded to them)."""
    if "DS_ACCELERATOR" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        os.environ["DS_ACCELERATOR"] = "cpu"
