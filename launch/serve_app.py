"""launch.serve's application: Ray Serve HTTP over a checkpoint, batched generation, sandboxed execution.

`start(opts, host, port, ...)` deploys it on the connected Ray (the CLI, launch/serve.py, calls it after its
checks; tests and benches call it on a cluster of their own).

Routes: `POST /v1/sql` {"question", "db_id", "evidence"?, "execute"?, "max_turns"?} -> the SQL (and with execute the
rows, row-capped, or a verdict-style error) and timings; `POST /v1/execute` {"db_id", "sql"} runs SQL
only; `GET /v1/databases` the db_ids with their tables and columns; `GET /v1/stats` this replica's
counters (and pid, nice); `GET /healthz` (answered in Ray Serve's proxy itself, or by an application of
its own, launch/serve_health.py: it never waits behind generation or SQL); `GET /` a page to try it by hand (launch/serve_page.py); the OpenAI-compatible
`GET /v1/models` and `POST /v1/chat/completions` (launch/serve_openai.py). Result rows come with
their `columns`.

Invariants:
- Prompts are the training prompts: the export's arctic_rl.json says how to render them (style, schema
  sample values, budget, chat template); generation is greedy with the project's engines
  (actors/engines: transformers on CPU, vLLM on GPU). Requests that arrive together are collected by
  `@serve.batch` and submitted to the engine at once, so they share its prefill and decode steps.
- SQL runs only in the sandbox (tasks/sandbox.py: read-only, time-, row- and memory-limited, in
  worker processes); a request can name a database only by db_id, never by path. The pool grows
  (--sql-workers up to --sql-max-workers) while every worker is busy, so runaway queries do not make
  the next query wait; each result reports `queue_wait_s` (waiting for a worker) apart from `execute_s`.
- Who gets in: --host other than loopback is refused (one line, exit 2, before anything else is checked)
  unless an API key is set (ARL_API_KEY or --api-key); with a key, every route but /healthz answers 401
  {"error": ...} unless the request carries `Authorization: Bearer <key>` (launch/serve_http.py). Every
  route of this app needs it: /healthz is answered in the proxy or by the health app (launch/serve_health.py).
- Health: Ray Serve's controller calls `check_health` on every replica (`health_check_period_s`,
  `health_check_timeout_s`): a replica whose sandbox pool is gone, or that does not answer in time, is
  replaced; /healthz reports the replicas the controller counts RUNNING. A model replica runs
  `replica_nice` nice levels below the proxy (launch/serve_life.py lower_priority), its SQL workers too.
- Bad input is a 4xx with {"error": "<one line naming the field>"}: 400 bad JSON, 413 a body over the
  cap, 422 a missing or ill-typed field or an over-long question/prompt, 404 an unknown db_id or route,
  405 a wrong method. An
  unexpected failure is a 500 with one line, never a traceback. Every wait is bounded (generation by
  --request-timeout, SQL by the sandbox's deadline, start-up by --start-timeout).
- The HTTP proxy binds 127.0.0.1 unless --host says otherwise; a new local Ray cluster is always
  our own (address="local", its own temp dir) and listens on loopback. A taken port is one line and
  exit 2 before Ray starts; Ctrl-C or SIGTERM at any moment leaves no Ray process, agent or temp dir
  (launch/serve_life.py).
"""

import asyncio
import itertools
import os
import time
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from launch.serve_health import (
    HEALTH_APP,
    HEALTH_PREFIX,
    MODEL_APP,
    MODEL_DEPLOYMENT,
    build_health,
    proxy_answers,
)
from launch.serve_http import (
    RequestError,
    ServeOptions,
    _error,
    auth_refusal,
    field_of,
    find_databases,
    json_value,
    read_json,
    request_turns,
)
from observe.logs import setup_actor_logging

APP_NAME = MODEL_APP


app = FastAPI(title="arctic-rl text-to-SQL", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(RequestError)
async def _bad_request(request: Request, e: RequestError) -> JSONResponse:
    return _error(e.status, e.reason)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return _error(e.status_code, f"{e.detail}: {request.method} {request.url.path}")


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    return _error(500, f"internal error: {type(e).__name__}: {e}")


@app.middleware("http")
async def _authorize(request: Request, call_next):
    """Every route of this app needs the key when the service has one (401, one line; /healthz is not
    routed here). The page's 401 offers HTTP Basic, so a browser asks for the key (as the password) and
    sends it on."""
    digest = serve.get_replica_context().servable_object.opts.api_key_sha256
    why = auth_refusal(digest, request.headers.get("authorization"))
    if why:
        response = _error(401, why)
        response.headers["WWW-Authenticate"] = 'Basic realm="arl-sql"' if request.url.path == "/" else "Bearer"
        return response
    return await call_next(request)


@serve.deployment(name=MODEL_DEPLOYMENT)
@serve.ingress(app)
class SqlService:
    def __init__(self, opts: dict):
        from launch.export import load_engine
        from launch.serve_life import lower_priority, replica_grpc_on_loopback
        from tasks.bird import read_schema, schema_text
        from tasks.sql_pool import SqlPool

        self.opts = ServeOptions(**opts)
        self.nice = lower_priority(self.opts.replica_nice)  # first: its threads and SQL workers inherit it
        self.log = setup_actor_logging("serve")
        replica_grpc_on_loopback()
        self.dbs = find_databases(self.opts.bird_dir, self.opts.split)
        self.engine, self.tokenizer, self.settings = load_engine(
            self.opts.model, self.opts.engine, self.opts.device, max_batch_prompts=max(1, self.opts.max_batch_size),
            max_tokens=self.opts.max_tokens, engine_kwargs=self.opts.engine_kwargs)
        sv, style = int(self.settings["sample_values"]), self.settings["prompt_style"]
        self.schemas = {db: read_schema(path, sv) for db, path in self.dbs.items()}
        self.schema_texts = {db: schema_text(s, style, sv) for db, s in self.schemas.items()}
        self.pool = SqlPool(workers=self.opts.sql_workers, max_workers=max(self.opts.sql_workers, self.opts.sql_max_workers),
                            timeout_s=self.opts.sql_timeout_s, max_rows=self.opts.sql_max_rows, memory_mb=1024)
        self.pool.wait_ready()  # bounded: the first queries are not slowed by the workers' start-up
        self.generate_batch.set_max_batch_size(max(1, self.opts.max_batch_size))
        self.generate_batch.set_batch_wait_timeout_s(self.opts.batch_wait_s)
        self.ids = itertools.count()
        self.counters = {"requests": 0, "batches": 0, "batched_requests": 0, "max_batch": 0}
        self.log.info("serve.ready", model=self.opts.model, databases=len(self.dbs), style=style,
                      max_batch_size=self.opts.max_batch_size, pid=os.getpid())

    def check_health(self) -> None:
        """Ray Serve's controller calls it every health_check_period_s; raising (or not answering within
        health_check_timeout_s) makes it replace this replica."""
        if not self.pool.alive:
            raise RuntimeError("the SQL sandbox pool is closed or its dispatcher thread died")

    def __del__(self):
        """Ray Serve calls it when the replica stops: the sandbox workers and their temp dir go with it."""
        for owner in (getattr(self, "pool", None), getattr(self, "_executor", None)):
            if owner is not None:
                owner.close()

    # -- generation ------------------------------------------------------------------------------

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def generate_batch(self, tasks: list) -> list:
        """One engine submission for every request collected: the engine batches them together."""
        self.counters["batches"] += 1
        self.counters["batched_requests"] += len(tasks)
        self.counters["max_batch"] = max(self.counters["max_batch"], len(tasks))
        results = await asyncio.gather(*(self.engine.generate(t) for t in tasks), return_exceptions=True)
        return [(r, len(tasks)) for r in results]

    def _episodes(self, max_turns: int):
        """The multi-turn runner (actors/generator/episode.py) for a request's max_turns; queries run in
        the service's own bounded executor under its SQL limits."""
        import msgspec

        from actors.generator.episode import EpisodeRunner
        from tasks.executor import ToolExecutor

        if getattr(self, "_executor", None) is None:
            self._executor = ToolExecutor(workers=2, timeout_s=self.opts.sql_timeout_s, max_rows=self.opts.sql_max_rows)
        return EpisodeRunner(self.engine, msgspec.structs.replace(self.engine.cfg, max_turns=max_turns), self.tokenizer,
                             self._executor)

    def _task(self, db_id: str, question: str, evidence: str, max_turns: int = 1):
        from policies.prompt import render_prompt, tokenize_prompt
        from queues.messages import PromptTask, pack_ids

        s = self.settings
        text = render_prompt(question, evidence, self.schema_texts[db_id], s["prompt_style"], max_turns)
        ids = tokenize_prompt(text, self.tokenizer, int(s["max_prompt_tokens"]), bool(s["use_chat_template"]))
        if ids is None:
            raise RequestError(422, f"the prompt for this question on {db_id!r} is over the model's prompt budget "
                                  f"of {s['max_prompt_tokens']} tokens")
        return PromptTask(task_id=f"serve:{next(self.ids)}", prompt_id="serve", step=-1, policy_version=0,
                          prompt_tokens=pack_ids(ids), n=1, db_id=db_id, db_path=self.dbs[db_id],
                          sampling={"temperature": 0.0}, published_at=time.time())

    async def _execute(self, db_id: str, sql: str) -> dict:
        from policies.sql_reward import SQL_ERROR, TIMEOUT, TOO_MANY_ROWS

        t = time.perf_counter()
        r = await asyncio.wait_for(self.pool.run(self.dbs[db_id], sql), self.opts.sql_timeout_s + 30)
        wall = time.perf_counter() - t  # queue_wait_s: waiting for a sandbox worker; execute_s: the rest
        out: dict[str, Any] = {"queue_wait_s": r.queue_wait_s, "execute_s": round(max(0.0, wall - r.queue_wait_s), 4)}
        if r.status == "ok":
            out.update(verdict="ok", error="", row_count=len(r.rows), truncated=len(r.rows) > self.opts.return_rows,
                       columns=list(r.columns),
                       rows=[[json_value(v) for v in row] for row in r.rows[: self.opts.return_rows]])
        else:
            verdict = {"timeout": TIMEOUT, "too_many_rows": TOO_MANY_ROWS}.get(r.status, SQL_ERROR)
            out.update(verdict=verdict, error=r.error, row_count=0, truncated=False, columns=[], rows=[])
        return out

    def _db(self, body: dict) -> str:
        db_id = field_of(body, "db_id", str)
        if db_id not in self.dbs:
            raise RequestError(404, f"unknown db_id {db_id!r} (GET /v1/databases lists {len(self.dbs)})")
        return db_id

    # -- routes ----------------------------------------------------------------------------------

    async def _answer(self, db_id: str, question: str, evidence: str, execute: bool, max_turns: int = 1) -> dict:
        """/v1/sql's answer (also the chat completions'): the SQL, the completion and, with execute,
        the rows or the verdict-style error; timings; `usage` (prompt and completion tokens)."""
        from actors.engines.base import TaskError
        from policies.sql_reward import GENERATION_ERROR, NO_SQL, extract_sql

        start = time.perf_counter()
        task = self._task(db_id, question, evidence, max_turns)
        self.counters["requests"] += 1
        try:
            if max_turns > 1:  # an episode: its turns are requests to the engine, which batches them itself
                group, batch = await asyncio.wait_for(self._episodes(max_turns).generate(task), self.opts.request_timeout_s), 1
            else:
                group, batch = await asyncio.wait_for(self.generate_batch(task), self.opts.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(504, f"generation took over {self.opts.request_timeout_s:g} s") from None
        gen_s = time.perf_counter() - start
        if isinstance(group, TaskError):
            raise RequestError(422, str(group))
        if isinstance(group, BaseException):
            raise group
        sample = group.samples[0]
        sql = (sample.answer or None) if max_turns > 1 else extract_sql(sample.text)
        out: dict[str, Any] = {"db_id": db_id, "question": question, "sql": sql, "completion": sample.text,
                               "finish_reason": sample.finish_reason, "batch_size": batch,
                               "usage": (len(task.prompt_tokens) // 4, len(sample.tokens) // 4)}
        if max_turns > 1:  # every turn: the queries it ran (the completion holds their observations)
            out.update(turns=sample.turns, queries=sample.queries, tool_errors=sample.tool_errors)
        timings = {"generate_s": round(gen_s, 4)}
        if execute:
            if sample.finish_reason == "error":
                out.update(verdict=GENERATION_ERROR, error="generation failed", rows=[], row_count=0, truncated=False)
            elif sql is None:
                out.update(verdict=NO_SQL, error="the completion holds no SQL", rows=[], row_count=0, truncated=False)
            else:
                result = await self._execute(db_id, sql)
                timings.update(queue_wait_s=result.pop("queue_wait_s"), execute_s=result.pop("execute_s"))
                out.update(result)
        timings["total_s"] = round(time.perf_counter() - start, 4)
        out["timings"] = timings
        self.log.info("serve.sql", db_id=db_id, batch=batch, verdict=out.get("verdict"), **timings)
        return out

    @app.post("/v1/sql")
    async def sql(self, request: Request) -> JSONResponse:
        body = await read_json(request)
        question = field_of(body, "question", str, max_chars=self.opts.max_question_chars)
        db_id = self._db(body)
        evidence = field_of(body, "evidence", str, required=False, max_chars=self.opts.max_evidence_chars) or ""
        execute = bool(field_of(body, "execute", bool, required=False))
        out = await self._answer(db_id, question, evidence, execute, request_turns(body, self.settings["max_turns"]))
        out.pop("usage")
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        from launch.serve_openai import models_list

        return JSONResponse(models_list(self.dbs))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        from launch.serve_openai import chat_response, parse_chat

        body = await read_json(request)
        question, db_id, evidence, execute = parse_chat(body, self.dbs, self.opts.max_question_chars,
                                                        self.opts.max_evidence_chars)
        out = await self._answer(db_id, question, evidence, execute, request_turns(body, self.settings["max_turns"]))
        prompt_tokens, completion_tokens = out.pop("usage")
        return JSONResponse(chat_response(out, body["model"], prompt_tokens, completion_tokens))

    @app.post("/v1/execute")
    async def execute(self, request: Request) -> JSONResponse:
        body = await read_json(request)
        db_id = self._db(body)
        sql = field_of(body, "sql", str, max_chars=100_000)
        result = await self._execute(db_id, sql)
        return JSONResponse({"db_id": db_id, "sql": sql, **result})

    @app.get("/v1/databases")
    async def databases(self) -> JSONResponse:
        return JSONResponse({"databases": [
            {"db_id": db, "tables": [{"name": t.name, "columns": [c.name for c in t.columns]} for t in s.tables]}
            for db, s in self.schemas.items()]})

    @app.get("/v1/stats")
    async def stats(self) -> JSONResponse:
        return JSONResponse({**self.counters, **self.engine.stats(), "pid": os.getpid(), "nice": self.nice,
                             "sql_queries": self.pool.queries,
                             "sql_workers": self.pool.workers, "sql_peak_workers": self.pool.peak_workers,
                             "sql_queue_wait_s": round(self.pool.queue_wait_s, 4)})

    @app.get("/")
    async def page(self) -> HTMLResponse:
        from launch.serve_page import PAGE

        return HTMLResponse(PAGE)


def build_app(opts: ServeOptions, replicas: int = 1, actor_options: dict | None = None, max_ongoing: int = 64,
              deployment_options: dict | None = None):
    """The model app; `deployment_options` go to SqlService.options (e.g. health_check_timeout_s)."""
    return SqlService.options(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                              ray_actor_options=actor_options or {"num_cpus": 1.0},
                              **(deployment_options or {})).bind(asdict(opts))


def start(opts: ServeOptions, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
          actor_options: dict | None = None, timeout_s: float = 600.0, deployment_options: dict | None = None) -> str:
    """Deploys the model app at `/` on the connected Ray cluster, then waits (bounded) until /healthz
    answers 200 from Ray Serve's proxy (launch/serve_health.py ProxyHealthz) or, where the proxy does not
    answer it, deploys the health app at `/healthz`; returns the URL. The deploy runs in a daemon
    thread, so an interrupt while it waits never leaves the process waiting on it at exit."""
    import threading

    serve.start(http_options={"host": host, "port": port, "request_timeout_s": opts.request_timeout_s + 60})
    outcome: list = []

    def deploy():
        try:
            serve.run(build_app(opts, replicas, actor_options, deployment_options=deployment_options),
                      name=APP_NAME, route_prefix="/")
            if not proxy_answers(host, port, timeout_s):
                serve.run(build_health(APP_NAME, MODEL_DEPLOYMENT, opts), name=HEALTH_APP, route_prefix=HEALTH_PREFIX)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            outcome.append(e)

    t = threading.Thread(target=deploy, name="serve-deploy", daemon=True)
    t.start()
    t.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"the service was not ready after {timeout_s:g} s (see the Ray logs)")
    if outcome[0] is not None:
        raise outcome[0]
    return f"http://{host}:{port}"
