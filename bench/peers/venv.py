"""The peer's own virtual environment: TRL beside the torch CPU wheel, never in the project's venv.

    python -m bench.peers.venv [--offline] [--venv DIR]      # build (or reuse) it; prints its python

Invariants:
- TRL is never a dependency of the project: it lives only in this venv (default /tmp/arl-peers-venv,
  or $ARL_PEERS_VENV), which nothing outside bench/peers imports or runs.
- `torch==2.13.0` is pinned in the same pip command (the CPU wheel the machine's pip config finds stays
  the one installed), and transformers is pinned to the project venv's version, so both sides run the
  same model code (offline: whatever transformers >= 5 the local sources have; the table then lists
  both versions as a difference).
- A venv is reused only when its python imports trl, torch and transformers and its torch and
  transformers are the pinned versions; a half-built one is removed and built again.
- `offline=True` replaces the default index by an unreachable one: pip then sees only the machine's
  local sources (its config's find-links and file:// extra indexes). CI must not depend on the network,
  so the test builds offline or skips, saying why (`PeerVenvUnavailable`, one line).
Stdlib only: it runs before the venv exists.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path(os.environ.get("ARL_PEERS_VENV", "/tmp/arl-peers-venv"))
TORCH_PIN = "torch==2.13.0"
TRL_SPEC = os.environ.get("ARL_PEERS_TRL", "trl>=1.13,<2")
# What the TRL side imports besides trl (datasets comes with trl); msgspec is not needed: the reward
# code it imports (tasks/sandbox.py, policies/sql_reward.py) is stdlib-only.
EXTRA = ("psutil",)
OFFLINE_INDEX = "file:///nonexistent-arl-offline-index/"
PIP_TIMEOUT_S = 1800


class PeerVenvUnavailable(RuntimeError):
    """The peer venv cannot be built here (offline and no local wheels, or pip failed): one line."""


def project_transformers() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


_PROBE = ("import json, importlib.metadata as m; import trl, torch, transformers; "
          "print(json.dumps({k: m.version(k) for k in ('trl', 'torch', 'transformers', 'datasets')}))")


def versions(venv: Path) -> dict[str, str] | None:
    """{package: version} of the venv's trl/torch/transformers/datasets, or None when it is not usable."""
    import json

    py = venv_python(venv)
    if not py.exists():
        return None
    try:
        out = subprocess.run([str(py), "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def usable(got: dict[str, str] | None, transformers_version: str | None) -> bool:
    """torch is the pinned version; transformers the project's (None: any, for an offline build)."""
    return (bool(got) and got["torch"].split("+")[0] == TORCH_PIN.split("==")[1]
            and (transformers_version is None or got["transformers"] == transformers_version))


def ensure_venv(venv: Path = DEFAULT_VENV, offline: bool = False, log=print) -> dict[str, str]:
    """Builds (or reuses) the peer venv; returns its versions, or raises PeerVenvUnavailable."""
    want_tf = None if offline else project_transformers()
    got = versions(venv)
    if usable(got, want_tf):
        return got
    if venv.exists():
        shutil.rmtree(venv)
    tf_spec = f"transformers=={want_tf}" if want_tf else "transformers>=5"
    log(f"peers: building {venv} ({TRL_SPEC}, {TORCH_PIN}, {tf_spec}{', offline' if offline else ''})")
    py = Path(sys.executable)
    base = getattr(sys, "_base_executable", None) or str(py)
    try:
        subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, text=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise PeerVenvUnavailable(f"python -m venv {venv} failed: {str(getattr(e, 'stderr', '') or e).strip()[:200]}") from None
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "-q", TORCH_PIN, tf_spec, TRL_SPEC, *EXTRA]
    if offline:
        env["PIP_INDEX_URL"] = OFFLINE_INDEX
        env["PIP_RETRIES"] = "0"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        shutil.rmtree(venv, ignore_errors=True)
        raise PeerVenvUnavailable(f"pip install into {venv} took over {PIP_TIMEOUT_S} s") from None
    if out.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        last = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
        raise PeerVenvUnavailable(f"pip could not install {TRL_SPEC}{' offline' if offline else ''} "
                                  f"into {venv}: {(last[-1] if last else 'no output')[:300]}")
    got = versions(venv)
    if not usable(got, want_tf):
        raise PeerVenvUnavailable(f"{venv} was built but does not have {TORCH_PIN} and {tf_spec}: {got}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.venv", description=__doc__.splitlines()[0])
    p.add_argument("--venv", default=str(DEFAULT_VENV))
    p.add_argument("--offline", action="store_true", help="only the machine's local package sources")
    args = p.parse_args(argv)
    try:
        got = ensure_venv(Path(args.venv), args.offline)
    except PeerVenvUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(venv_python(Path(args.venv)), " ".join(f"{k}={v}" for k, v in got.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
