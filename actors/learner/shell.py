"""The learner's Ray shell: one rank actor (`LearnerActor`), the thin layer the coordinator and the
LearnerGroup call; all training behaviour lives in actors/learner/learner.py. Built like every actor
(actors/shell.py): `LearnerShell(cfg.learner, ctx, model_cfg=..., rank=..., world_size=...)`, each rank
by the launcher (launch/create.py create_learner).

Invariants:
- Rank 0 alone reads the `batches` stream (consumer "learner-0", the one consumer loop in pull mode:
  queues.worker.Worker.take), keeps the ledger of trained steps (saved with each checkpoint) and acks
  a batch only once its step is trained; a batch of a step already trained is acked and skipped, so
  a resumed run never trains a step twice.
- A world of one trains straight from the stream (`train_from_stream`); a larger world goes
  through `take_batch` / `train_taken` + `train_bytes` / `finish_taken` driven by the group.
- Weight sync is one verb, `send_weights(call)`, forwarded to this rank's end of the transport
  (weights.endpoint.SendEnd): which rank sends what, and how, is the transport's (weights/).
- Importing this module never imports or starts Ray, nor torch or the Learner (built in the
  constructor): a process that only holds a handle to a rank (the coordinator, through its
  LearnerGroup) imports this module when Ray rebuilds the handle, and stays light.
"""
from __future__ import annotations

import os

import structlog

from actors.shell import built_with_gc_paused
from config import LearnerConfig, ModelConfig, RunContext
from observe.logs import setup_actor_logging
from queues.messages import TrainBatch

log = structlog.get_logger("arctic_rl.learner")


class LearnerShell:
    """One learner rank: a Learner plus (rank 0) its batches stream, and its side of weight sync.

    A world of one builds its Learner in the constructor; a rank of a larger world builds it in
    `join`, once rank 0 `listen`s (actors/learner/group.py drives that).
    """

    RAY_OPTIONS = {"max_concurrency": 4}  # weight-sync and stats calls beside a training step

    @built_with_gc_paused
    def __init__(self, learner_cfg: LearnerConfig, ctx: RunContext | None = None, *, model_cfg: ModelConfig,
                 model_path: str, total_steps: int, micro_batch_tokens: int, temperature: float = 1.0, rank: int = 0,
                 world_size: int = 1):
        import torch

        from actors.learner.learner import Learner

        torch.set_num_threads(max(1, int(learner_cfg.num_cpus)))
        self.ctx = ctx or RunContext()
        setup_actor_logging("learner" if world_size == 1 else f"learner-{rank}", self.ctx)
        self.rank, self.world_size = int(rank), int(world_size)
        self._args = (learner_cfg, model_cfg, model_path, total_steps, micro_batch_tokens, temperature)
        self._store = None
        self.learner = Learner(*self._args) if self.world_size == 1 else None
        self.trained_steps: set[int] = set()
        self.train_counts: dict[int, list[int]] = {}  # step -> [times trained, groups in its batch]
        from weights.endpoint import SendEnd

        self._weights_out = SendEnd(lambda *a, **kw: self.learner.export_weights(*a, **kw), self.rank,
                                    device=lambda: self.learner.device, timeout_s=learner_cfg.collective_timeout_s)
        self._taken = None  # (msg_id, batch) read from the stream, trained, not yet acked

    def __repr__(self) -> str:  # the Ray dashboard's Repr column: live state
        learner = getattr(self, "learner", None)  # Ray may ask before __init__ ends
        if learner is None:
            return f"LearnerShell(rank {getattr(self, 'rank', '?')}: starting)"
        return (f"LearnerShell(rank {self.rank}/{self.world_size}: step {learner.step}, "
                f"{'asleep' if learner.asleep else 'awake'}, {len(getattr(self, 'trained_steps', ()))} steps trained)")

    def node_ip(self) -> str:
        """This rank's node address as Ray reports it (the group decides from all ranks' where to bind)."""
        from weights.broadcast import node_ip

        return node_ip()

    def listen(self, host: str | None = None) -> tuple[str, int]:
        """Rank 0 of a world > 1: binds the world's store on `host` (default: this node's address);
        returns where the others connect."""
        from actors.learner.world import bind_store

        self._store, host, port = bind_store(self.world_size, self._args[0].collective_timeout_s, host=host)
        return host, port

    @built_with_gc_paused
    def join(self, host: str, port: int, local_host: str | None = None) -> None:
        """Every rank of a world > 1, concurrently: joins the process group (gloo bound to `local_host`),
        then builds the Learner (deepspeed.initialize is collective)."""
        import torch

        from actors.learner.learner import Learner
        from actors.learner.world import init_world

        device = self._args[0].device
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        init_world(self.rank, self.world_size, "nccl" if cuda else "gloo", self._args[0].collective_timeout_s,
                   store=self._store, host=host, port=port, local_host=local_host)
        self.learner = Learner(*self._args)

    async def connect(self) -> None:
        """Rank 0: the run's batches stream (ctx), read by the one consumer loop in pull mode
        (queues.worker.Worker.take). The first `_take` connects by itself if this was not called."""
        from queues.streams import RunStreams
        from queues.topology import BATCHES
        from queues.worker import Worker

        if getattr(self, "batch_worker", None) is not None:
            return
        if not self.ctx.redis_url:
            raise RuntimeError("learner: its RunContext has no redis_url")
        self.conn = await RunStreams.open(self.ctx.redis_url, self.ctx.run_id)
        self.batches = self.conn.stream(BATCHES)
        await self.batches.ensure_group()
        self.batch_worker = Worker(self.batches, "learner-0", reclaim_idle_s=self.ctx.reclaim_idle_s, block_ms=500,
                                   read_count=4)

    async def _take(self, step: int, timeout_s: float) -> tuple[str, TrainBatch, bytes]:
        """The batch for `step` from the stream; acks (and skips) batches of steps already trained and
        leaves a later step's batch pending for its turn."""
        from queues.messages import codec

        await self.connect()
        decode = codec(TrainBatch).decode

        async def pick(msg_id: str, data: bytes) -> tuple[TrainBatch, bytes] | None:
            batch = decode(data)
            if batch.step in self.trained_steps or batch.step < step:
                await self.batches.ack([msg_id])
                return None
            return (batch, data) if batch.step == step else None

        got = await self.batch_worker.take(pick, timeout_s)
        if got is None:
            raise TimeoutError(f"learner: no TrainBatch for step {step} on stream {self.batches.key} (group learner) "
                               f"within {timeout_s:.0f}s")
        msg_id, (batch, data) = got
        return msg_id, batch, data

    async def _finish(self, msg_id: str, batch: TrainBatch, metrics: dict) -> dict:
        self.trained_steps.add(batch.step)
        count = self.train_counts.setdefault(batch.step, [0, 0])
        count[0] += 1
        count[1] += len(batch.groups)
        await self.batches.ack([msg_id])
        return dict(metrics, train_groups=float(len(batch.groups)))

    async def train_from_stream(self, step: int, timeout_s: float = 600.0) -> dict:
        """A world of one: trains on the batch for `step`, then acks it."""
        import asyncio

        msg_id, batch, _ = await self._take(step, timeout_s)
        metrics = await asyncio.get_running_loop().run_in_executor(None, self.learner.train_step, batch)
        return await self._finish(msg_id, batch, metrics)

    async def take_batch(self, step: int, timeout_s: float = 600.0) -> list:
        """Rank 0 of a world > 1: reads the step's batch and returns [ObjectRef of its bytes] for the
        other ranks (a list, so Ray hands the reference through instead of resolving it)."""
        import ray

        msg_id, batch, data = await self._take(step, timeout_s)
        self._taken = (msg_id, batch)
        return [ray.put(data)]

    async def train_taken(self) -> dict:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self.learner.train_step, self._taken[1])

    async def train_bytes(self, data: bytes) -> dict:
        """Ranks > 0: the same step from the bytes rank 0 read."""
        import asyncio

        from queues.messages import codec

        batch = codec(TrainBatch).decode(data)
        return await asyncio.get_running_loop().run_in_executor(None, self.learner.train_step, batch)

    async def finish_taken(self, metrics: dict) -> dict:
        """Rank 0, after every rank trained: records the step and acks its message."""
        (msg_id, batch), self._taken = self._taken, None
        return await self._finish(msg_id, batch, metrics)

    def sft_step(self, pairs, lr=None) -> float:
        return self.learner.sft_step(pairs, lr=lr)

    def sft_steps(self, chunks, lr=None) -> dict:
        """Many warm-start steps in one call (Learner.sft_steps): {"losses", "seconds"}."""
        return self.learner.sft_steps(chunks, lr=lr)

    async def send_weights(self, call):
        """This rank's step of a weight sync (a weights.WeightsCall from the coordinator or the group)."""
        return await self._weights_out.handle(call)

    def save(self, path: str) -> str:
        import json
        import os

        out = self.learner.save(path)
        if self.rank > 0:
            return out
        with open(os.path.join(path, "trained_steps.json"), "w") as f:
            json.dump(sorted(self.trained_steps), f)
        with open(os.path.join(path, "train_counts.json"), "w") as f:
            json.dump({str(k): v for k, v in sorted(self.train_counts.items())}, f)
        return out

    def load(self, path: str) -> int:
        import json
        import os

        step = self.learner.load(path)
        marker = os.path.join(path, "trained_steps.json")
        if os.path.exists(marker):
            self.trained_steps = set(json.load(open(marker)))
        counts = os.path.join(path, "train_counts.json")
        if os.path.exists(counts):
            self.train_counts = {int(k): v for k, v in json.load(open(counts)).items()}
        return step

    def pid(self) -> int:
        return os.getpid()

    def sleep(self) -> None:
        self.learner.sleep()

    def wake(self) -> None:
        self.learner.wake()

    def export_hf(self, path: str) -> str:
        return self.learner.export_hf(path)

    def save_base(self, path: str) -> str:
        return self.learner.save_base(path)

    def memory(self) -> dict:
        return self.learner.memory()

    def get_step(self) -> int:
        return self.learner.step


def __getattr__(name: str):
    if name == "LearnerActor":  # Ray's actor class, made on first use (importing this module imports no Ray)
        from actors.shell import ray_actor

        return ray_actor(LearnerShell)
    raise AttributeError(name)
