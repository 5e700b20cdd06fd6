"""Preflight probes: one light actor per planned actor, placed exactly as the launcher places the real one.

Invariants:
- Importing this module imports the standard library and ray only. torch (and torch.distributed)
  is imported inside the calls that need it: the learner ranks' all-reduce and the weight-sync
  bucket. A probe that only reports its place never loads it.
- The weight sync is the real one: a probe holds a learner rank's and a generator's ends of the
  transport (weights.endpoint) and answers their verbs, ``send_weights`` and ``receive_weights``;
  only the exported tensor (one probe bucket) and the loader (kept for ``ws_check``) are its own.
- No model, tokenizer or dataset is read; `report` only checks that given paths are readable.
- Every call that waits on other processes is bounded by its `timeout_s` (gloo/NCCL timeouts on the
  group, TCPStore timeouts on the rendezvous); the driver bounds each ray.get as well.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any

import ray

PROBE_NAME = "preflight.probe"
PROBE_NUMEL = 4096  # float32: 16 KiB, one bucket


def bundle_gpu_ids() -> list[int]:
    """Run as a task in a bundle: the GPU ids Ray gives that bundle (node-local)."""
    return [int(x) for x in ray.get_gpu_ids()]


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return socket.gethostbyname(socket.gethostname())


def _free_memory_mib(gpu_ids: list[int]) -> list[int] | None:
    """Free device memory per GPU from nvidia-smi (no CUDA context created); None without GPUs."""
    if not gpu_ids:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    free = {int(i): int(m) for i, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}
    return [free[g] for g in gpu_ids if g in free] or None


def redis_ping(url: str, timeout_s: float) -> str:
    """'' when Redis answers PING at `url`, else the reason (one line)."""
    if not url:
        return ""
    try:
        from queues.streams import ping_blocking

        ping_blocking(url, timeout_s)
        return ""
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        from queues.streams import redact

        hint = (" (a unix socket reaches one machine only: give every node REDIS_URL=redis://host:port)"
                if url.startswith("unix") else "")
        return redact(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")[:200] + hint


def unreadable(paths: list[str]) -> list[str]:
    """The paths (files or directories) this process cannot read."""
    bad = []
    for p in paths:
        if not p:
            continue
        ok = os.access(p, os.R_OK) and (not os.path.isdir(p) or os.access(p, os.X_OK))
        if not ok:
            bad.append(p)
    return bad


class Probe:
    """Stands where `name` will stand. Async methods (the weight-sync receivers) make it an async actor."""

    def __init__(self, name: str):
        self.name = name
        self._weights_out: Any = None
        self._weights_in: Any = None
        self.received: list[Any] = []
        self._store = None
        self._group = None

    def report(self, redis_url: str = "", paths: list[str] | None = None, timeout_s: float = 5.0) -> dict:
        ctx = ray.get_runtime_context()
        gpu_ids = [int(x) for x in ray.get_gpu_ids()]
        return {"name": self.name, "node_id": ctx.get_node_id(), "ip": _node_ip(), "pid": os.getpid(),
                "gpu_ids": gpu_ids, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "free_mib": _free_memory_mib(gpu_ids), "redis": redis_ping(redis_url, timeout_s),
                "unreadable": unreadable(paths or [])}

    # ---------------------------------------------------------------- learner ranks: one all-reduce

    def store_listen(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0: a TCPStore on this node's address alone (never every interface)."""
        import datetime

        import torch.distributed as dist

        host = _node_ip()
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(max(128, world_size))
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
        return host, port

    def all_reduce(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> float:
        """Sum of (rank + 1) over the group: world_size * (world_size + 1) / 2 when every rank took part."""
        import datetime

        import torch
        import torch.distributed as dist

        from weights.broadcast import _make_group

        timeout = datetime.timedelta(seconds=timeout_s)
        store = self._store if rank == 0 else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        local = "127.0.0.1" if host.startswith("127.") else _node_ip()
        self._group = _make_group(dist.PrefixStore("arl-preflight", store), rank, world_size, backend, timeout, local)
        device = "cuda" if backend == "nccl" else "cpu"
        t = torch.tensor([float(rank + 1)], device=device)
        self._group.allreduce([t]).wait(timeout)
        return float(t.item())

    # ---------------------------------------------------------------- one weight-sync bucket

    @staticmethod
    def _export(bucket_mb: float, device: Any = None):
        """The learner's export_weights shape: one bucket of one tensor, on `device` (the transport's)."""
        import torch

        yield [(PROBE_NAME, torch.arange(PROBE_NUMEL, dtype=torch.float32, device=device or "cpu"))]

    def weight_ends(self, rank: int, device: str, timeout_s: float) -> None:
        """This probe's two ends of the real transport (weights.endpoint), as a learner rank and a
        generator hold them: `device` is the rank's ("cuda" or "cpu"), `timeout_s` bounds a group's waits."""
        from weights.endpoint import ReceiveEnd, SendEnd

        self._weights_out = SendEnd(self._export, rank, device=lambda: device, timeout_s=timeout_s)
        self._weights_in = ReceiveEnd(self._load, lambda: None)  # no engine: the probe loads itself

    async def send_weights(self, call: Any) -> Any:
        """A learner rank's verb (actors/learner/shell.py's, over a probe tensor)."""
        return await self._weights_out.handle(call)

    async def receive_weights(self, call: Any) -> Any:
        """A generator's verb (actors/generator/shell.py's, loading into `received`)."""
        reply, _ = await self._weights_in.handle(call)
        return reply

    def _load(self, named, version):
        self.received = [(n, t.detach().to("cpu").clone()) for n, t in named]

    def ws_check(self) -> str:
        """'' when the one tensor of the bucket arrived bit for bit, else what arrived."""
        import torch

        if len(self.received) != 1 or self.received[0][0] != PROBE_NAME:
            return f"received {[n for n, _ in self.received]}"
        if not torch.equal(self.received[0][1], torch.arange(PROBE_NUMEL, dtype=torch.float32)):
            return "the bucket's values differ from what was sent"
        return ""

    def ping(self) -> float:
        return time.time()
