"""The run context: the one thing besides its config section that every actor of a run is built from.

    RunContext(run_id, run_dir, redis_url, log_level, stream_high_water, reclaim_idle_s, data_dir)

The launcher (launch/run.py) builds one per run (`RunContext.of(cfg, ...)`) and hands the same one
(launch/create.py, launch/place.py) to every actor's constructor: the coordinator, the assembler, the
scorers, the generators and every learner rank. So the Redis URL, the run's directory (its logs) and the stream settings arrive one way.

Invariants:
- Frozen, plain values only (strings and numbers): it pickles to any Ray actor as is, and an actor
  that Ray restarts is rebuilt from the same context. Its repr leaves the Redis URL out (a password
  in REDIS_URL never reaches a log through it).
- A leaf like the rest of config/: it imports nothing of ours but config's schema, and no Ray.
- An empty field means "none here": no `redis_url`, no Redis (a plain class in a test that needs none);
  no `run_dir`, no log file (observe.logs.setup_actor_logging then writes nowhere new); no
  `data_dir`, no containment check of the databases the scorer opens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from config.schema import RunConfig


@dataclass(frozen=True)
class RunContext:
    run_id: str = ""
    run_dir: str = ""  # config.layout's root: logs/<actor>.jsonl, checkpoints, exports
    redis_url: str = field(default="", repr=False)  # every stream of the run; may hold a password: never in repr
    log_level: str = "info"  # logging.level
    stream_high_water: int = 4096  # cluster.stream_high_water: a producer waits above it
    reclaim_idle_s: float = 30.0  # cluster.reclaim_idle_s: the one consumer loop's reclaim bound
    data_dir: str = ""  # the run's task data (BIRD or synthetic): the scorer opens databases under it only

    @classmethod
    def of(cls, cfg: RunConfig, run_id: str, run_dir: str | Path, redis_url: str, data_dir: str | Path = "") -> "RunContext":
        """The context of a run of `cfg`: its settings taken from cfg.cluster and cfg.logging."""
        return cls(run_id=run_id, run_dir=str(run_dir), redis_url=redis_url, log_level=cfg.logging.level,
                   stream_high_water=int(cfg.cluster.stream_high_water), reclaim_idle_s=float(cfg.cluster.reclaim_idle_s),
                   data_dir=str(data_dir) if data_dir else "")
