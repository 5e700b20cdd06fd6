"""Stand-ins for the launcher's consumer actors (generators, scorers, the assembler) in tests that cannot or
need not build the real ones: the shape the launcher's start and teardown (launch/place.py) call on them.
Invariant: `run()` loops until `stop()`; `close()` answers at once."""
from __future__ import annotations

import asyncio


class LoopingConsumer:
    """A consumer's loop (run until stop) and close: the generator's and scorer's shape."""

    async def run(self, *args):
        self.stopped = False
        while not self.stopped:
            await asyncio.sleep(0.05)

    async def stop(self):
        self.stopped = True

    async def close(self):
        return None
