"""Multi-turn episodes over any engine: generate until the tool block closes, run the query, append the
observation's ids, continue, until the model answers or `generator.max_turns` is reached.

Invariants:
- One task still yields one group of `n` samples; each sample is one episode, run concurrently with
  the others (and with every other task's episodes) as n=1 requests to the engine, so a slow query
  holds one episode, never the group's other samples or other prompts.
- Token in, token out (policies/episode.py): every turn's request is the prompt's ids plus the
  episode's ids so far, exactly as sampled and as the observation was tokenized alone; nothing is
  decoded and re-tokenized. The sample's `loss_mask` is 1 on sampled ids and 0 on observation ids,
  whose log-probs are 0.0; `versions` gives observation ids the version of the turn before them.
- A turn ends at its first tool-block close tag even where the engine missed that stop string (vLLM
  partial rollouts: a tag straddling the resubmission point); the ids sampled past it are dropped.
- A sample's `text` is the transcript: each turn's kept ids decoded (with the close tag an engine cuts from
  its own text) and each observation block.
- An interrupted turn (partial rollouts) continues inside the engine under the new weights at its next
  token; the runner sees one turn whose `versions` change mid-way.
- The response budget (`max_tokens`) counts every id after the prompt, observations included.
- An aborted turn aborts its episode (finish "abort"): the generator fails the whole group.
- A generator that dies mid-episode has acked nothing: its prompt is reclaimed and re-run whole.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from actors.engines.base import Engine, resolve_sampling
from config import GeneratorConfig
from policies import episode as ep
from policies.sql_reward import extract_sql
from queues.messages import (
    PromptTask,
    RolloutGroup,
    Sample,
    episode_turn_id,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)


class EpisodeRunner:
    def __init__(self, engine: Engine, generator_cfg: GeneratorConfig, tokenizer: Any, executor: Any):
        self.engine, self.cfg, self.tokenizer, self.executor = engine, generator_cfg, tokenizer, executor
        self.max_turns = generator_cfg.max_turns
        self.max_obs = generator_cfg.max_observation_tokens

    async def generate(self, task: PromptTask) -> RolloutGroup:
        settings = resolve_sampling(self.cfg, task)  # TaskError on a bad override, as the engine would
        started = time.time()
        prompt = unpack_ids(task.prompt_tokens).tolist()
        episodes = await asyncio.gather(*(self._episode(task, prompt, settings, i) for i in range(settings.n)))
        version = min(int(v.min()) if len(v) else self.engine.version for _, v in episodes)
        for sample, v in episodes:  # per-token versions only where some token is not the group's version
            sample.versions = pack_ids(v) if len(v) and (v != version).any() else b""
        return RolloutGroup(task=task, samples=[s for s, _ in episodes], policy_version=version, started_at=started,
                            finished_at=time.time())

    async def _episode(self, task: PromptTask, prompt: list[int], settings, index: int) -> tuple[Sample, np.ndarray]:
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        texts: list[str] = []
        queries: list[str] = []
        errors, waited = 0, 0.0
        finish, turn_text, turns = "length", "", 0
        stop = list(settings.stop) + [ep.TOOL_CLOSE]
        for turn in range(self.max_turns):
            budget = settings.max_tokens - len(ids)
            if budget < 1:
                finish = "length"
                break
            sampling = dict(task.sampling or {})
            sampling.update(n=1, max_tokens=budget, stop=stop)
            if settings.seed is not None:
                sampling["seed"] = settings.seed + 7919 * index + turn
            request = PromptTask(task_id=episode_turn_id(task.task_id, index, turn), prompt_id=task.prompt_id, step=task.step,
                                 policy_version=task.policy_version, prompt_tokens=pack_ids(prompt + ids), n=1,
                                 sampling=sampling, db_id=task.db_id, db_path=task.db_path, gold_sql=task.gold_sql,
                                 published_at=task.published_at)
            group = await self.engine.generate(request)
            (s,) = group.samples
            turns += 1
            new = unpack_ids(s.tokens).tolist()
            v = (unpack_ids(s.versions).tolist() if s.versions else [group.policy_version] * len(new))
            lps = unpack_floats(s.logprobs).tolist()
            finish = s.finish_reason
            end = ep.tool_block_end(self.tokenizer, new) if finish in ("stop", "length") else None
            if end is not None and end < len(new):  # the engine ran past the close tag: the turn ends there
                new, v, lps, finish = new[:end], v[:end], lps[:end], "stop"
            ids += new
            logprobs += lps
            mask += [1] * len(new)
            versions += v
            turn_text = self.tokenizer.decode(new, skip_special_tokens=True)
            texts.append(turn_text)  # the kept ids decoded: keeps the close tag an engine cuts from its text
            if finish == "abort":
                break
            sql = ep.tool_query(turn_text) if finish == "stop" else None
            if sql is None:
                break  # the turn answered (or ran out of tokens): the episode ends
            queries.append(sql)
            if turn == self.max_turns - 1:
                break  # no turn left to read an observation: the last query is the answer
            result = await self.executor.run(task.db_path, sql)
            waited += result.seconds
            errors += int(result.status != "ok")
            body = ep.observation_text(result.status, result.columns, result.rows, result.error)
            obs = ep.observation_ids(self.tokenizer, body, min(self.max_obs, settings.max_tokens - len(ids)))
            if len(ids) + len(obs) >= settings.max_tokens:
                finish = "length"
                break
            ids += obs
            logprobs += [0.0] * len(obs)
            mask += [0] * len(obs)
            versions += [versions[-1]] * len(obs)
            texts.append(ep.OBS_OPEN + body + ep.OBS_CLOSE)
        answer = ep.final_answer(turn_text, queries, extract_sql) if finish != "abort" else ""
        sample = Sample(tokens=pack_ids(ids), logprobs=pack_floats(logprobs), finish_reason=finish,
                        text="".join(texts), loss_mask=pack_ids(mask) if 0 in mask else b"", turns=turns,
                        queries=queries, tool_errors=errors, answer=answer, executor_wait_s=waited)
        return sample, np.asarray(versions, dtype="<i4")
