"""Fresh processes for the tests that start their own ranks or receivers with multiprocessing.

Invariant: every such process is forked from multiprocessing's fork server, which imports torch, DeepSpeed
and the weight-sync package once per test session (whichever test starts it first); nothing else is
shared: no process group, store or socket exists in the server, and each child builds its own, as a
"spawn" child would. A child then starts in about a second instead of importing them anew (10-40 s on
2 busy cores).
"""
from __future__ import annotations

import multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.comm", "weights"]


def fresh_processes(*modules: str):
    """The fork-server context; `modules` (the caller's, whose functions the children run) are imported
    in the server too when this call is the one that starts it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *modules])
    return ctx
