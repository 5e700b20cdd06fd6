"""The PromptTasks the coordinator publishes: a step's training prompts and an evaluation's held-out ones.

Invariants:
- Pure: items (tasks.bird / tasks.synthetic prompt items) in, PromptTasks out; nothing published here.
- Task ids say what a task is (queues.messages: train_task_id(step, slot), eval_task_id(step, tag, k)), so
  a slot is never reused within a step (a step's replacements continue after its first slots).
- An evaluation task has step -1 and its prompt id prefixed EVAL_PREFIX: never trained on.
"""
from __future__ import annotations

import time

from queues.messages import EVAL_PREFIX, PromptTask, eval_task_id, train_task_id


def train_tasks(items: list, step: int, indices: list[int], version: int, n: int, first_slot: int = 0) -> list[PromptTask]:
    """`items[i]` for each of `indices`, as tasks of `step` in slots from `first_slot`, `n` samples each."""
    now = time.time()
    return [PromptTask(task_id=train_task_id(step, first_slot + slot), prompt_id=items[i].prompt_id, step=step,
                       policy_version=version, prompt_tokens=items[i].prompt_tokens, n=n, db_id=items[i].db_id,
                       db_path=items[i].db_path, gold_sql=items[i].gold_sql, difficulty=items[i].difficulty,
                       published_at=now)
            for slot, i in enumerate(indices)]


def eval_tasks(items: list, step: int, version: int, tag: str, n: int, sampling: dict) -> list[PromptTask]:
    """Every held-out item as an evaluation task of the evaluation after `step` (`tag`: g greedy, s sampled)."""
    return [PromptTask(task_id=eval_task_id(step, tag, k), prompt_id=f"{EVAL_PREFIX}{it.prompt_id}", step=-1,
                       policy_version=version, prompt_tokens=it.prompt_tokens, n=n, db_id=it.db_id,
                       db_path=it.db_path, gold_sql=it.gold_sql, difficulty=it.difficulty, sampling=sampling,
                       published_at=time.time())
            for k, it in enumerate(items)]
