"""A text-to-SQL service over a checkpoint: the command line (launch/serve_app.py is the application).

    python -m launch.serve --model runs/<run>/hf/step_<N> --bird-dir DIR [--split dev] [--replicas N]
                           [--host 127.0.0.1] [--port 8000] [--engine transformers|vllm] [--max-batch-size 8]
    ARL_API_KEY=<secret> python -m launch.serve ... --host 0.0.0.0     # beyond loopback: a key is required

Invariant: bad input (a host without a key, a model or database directory that is not one, a taken port) is one
line and exit 2 before Ray or Ray Serve is imported (~3 s on 2 cores); launch/serve_life.py checks it, then
starts our own Ray and calls the application's `start`.
"""
from __future__ import annotations

import sys


def _start(*args, **kwargs) -> str:
    from launch.serve_app import start

    return start(*args, **kwargs)


def _cluster_env(opts, databases: int) -> dict[str, str]:
    from launch.serve_health import MODEL_APP, MODEL_DEPLOYMENT, proxy_env

    return proxy_env(MODEL_APP, MODEL_DEPLOYMENT, opts, databases)


def main(argv: list[str] | None = None) -> int:
    """The CLI (launch/serve_life.py: checks, our own Ray, the service, a clean stop)."""
    from launch.serve_life import main as cli

    return cli(argv, _start, _cluster_env)


if __name__ == "__main__":
    sys.exit(main())
