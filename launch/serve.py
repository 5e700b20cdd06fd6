"""A text-to-SQL service over a checkpoint: Ray Serve HTTP, batched generation, sandboxed execution.

    python -m launch.serve --model runs/<run>/hf/step_<N> --bird-dir DIR [--split dev] [--replicas N]
                           [--host 127.0.0.1] [--port 8000] [--engine transformers|vllm] [--max-batch-size 8]

Routes: `POST /v1/sql` {"question", "db_id", "evidence"?, "execute"?, "max_turns"?} -> the SQL (and with execute the
rows, row-capped, or a verdict-style error) and timings; `POST /v1/execute` {"db_id", "sql"} runs SQL
only; `GET /v1/databases` the db_ids with their tables and columns; `GET /v1/stats` this replica's
counters; `GET /healthz`; `GET /` a page to try it by hand (launch/serve_page.py).

Invariants:
- Prompts are the training prompts: the export's arctic_rl.json says how to render them (style, schema
  sample values, budget, chat template); generation is greedy with the project's engines
  (actors/engines: transformers on CPU, vLLM on GPU). Requests that arrive together are collected by
  `@serve.batch` and submitted to the engine at once, so they share its prefill and decode steps.
- SQL runs only in the sandbox (tasks/sandbox.py: read-only, time-, row- and memory-limited, in
  worker processes); a request can name a database only by db_id, never by path.
- Bad input is a 4xx with {"error": "<one line naming the field>"}: 400 bad JSON, 413 a body over the
  cap, 422 a missing or ill-typed field or an over-long question/prompt, 404 an unknown db_id. An
  unexpected failure is a 500 with one line, never a traceback. Every wait is bounded (generation by
  --request-timeout, SQL by the sandbox's deadline, start-up by --start-timeout).
- The HTTP proxy binds 127.0.0.1 unless --host says otherwise; a new local Ray cluster is always
  our own (address="local", its own temp dir).
"""

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from ray import serve

from observe.logs import setup_actor_logging

APP_NAME = "arl-sql"
MAX_BODY_BYTES = 64 * 1024


@dataclass
class ServeOptions:
    model: str
    bird_dir: str
    split: str = "dev"
    engine: str = ""  # "" -> vllm with a GPU, transformers otherwise
    device: str = "auto"
    max_batch_size: int = 8  # requests per @serve.batch call (1: no batching)
    batch_wait_s: float = 0.02
    max_tokens: int = 0  # 0: the export's
    max_question_chars: int = 2000
    max_evidence_chars: int = 4000
    request_timeout_s: float = 120.0
    sql_timeout_s: float = 10.0
    sql_workers: int = 2
    sql_max_rows: int = 10_000  # more is the verdict too_many_rows
    return_rows: int = 200  # rows sent back (row_count says how many there were)
    engine_kwargs: dict = field(default_factory=dict)


class RequestError(Exception):
    """A request the service answers with `status` and {"error": reason} (one line)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def find_databases(bird_dir: str | Path, split: str) -> dict[str, str]:
    """{db_id: sqlite path} of <bird_dir>/<split>_databases/<db_id>/<db_id>.sqlite (ValueError, one line)."""
    from tasks.bird import database_path

    root = Path(bird_dir) / f"{split}_databases"
    if not root.is_dir():
        raise ValueError(f"databases directory not found: {root} (--bird-dir / --split)")
    dbs = {p.name: str(database_path(bird_dir, split, p.name).resolve()) for p in sorted(root.iterdir())
           if database_path(bird_dir, split, p.name).is_file()}
    if not dbs:
        raise ValueError(f"no <db_id>/<db_id>.sqlite under {root}")
    return dbs


def field_of(body: Any, name: str, kind: type, required: bool = True, max_chars: int = 0) -> Any:
    """One checked field of a request body (RequestError 422 naming it)."""
    if name not in body or body[name] is None:
        if required:
            raise RequestError(422, f"missing field {name!r}")
        return None
    value = body[name]
    if kind is bool and not isinstance(value, bool) or kind is str and not isinstance(value, str):
        raise RequestError(422, f"field {name!r} must be a {'boolean' if kind is bool else 'string'}, got {type(value).__name__}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RequestError(422, f"field {name!r} must be an integer, got {type(value).__name__}")
    if kind is str:
        value = value.strip()
        if required and not value:
            raise RequestError(422, f"field {name!r} is empty")
        if max_chars and len(value) > max_chars:
            raise RequestError(422, f"field {name!r} is {len(value)} characters, the limit is {max_chars}")
    return value


async def read_json(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"body is {declared} bytes, the limit is {MAX_BODY_BYTES}")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"body is {len(raw)} bytes, the limit is {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"body must be a JSON object, got {type(body).__name__}")
    return body


def json_value(v: Any) -> Any:
    """A SQLite value as JSON can carry it (bytes as hex, non-finite floats as text)."""
    if isinstance(v, bytes):
        return "0x" + v.hex()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason.replace("\n", " ")[:500]}, status_code=status)


app = FastAPI(title="arctic-rl text-to-SQL", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(RequestError)
async def _bad_request(request: Request, e: RequestError) -> JSONResponse:
    return _error(e.status, e.reason)


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    return _error(500, f"internal error: {type(e).__name__}: {e}")


MAX_TURNS = 8  # /v1/sql's max_turns at most


@serve.deployment(name="SqlService")
@serve.ingress(app)
class SqlService:
    def __init__(self, opts: dict):
        from launch.export import load_engine
        from tasks.bird import read_schema, schema_text
        from tasks.sandbox import SqlPool

        self.opts = ServeOptions(**opts)
        self.log = setup_actor_logging("serve")
        self.dbs = find_databases(self.opts.bird_dir, self.opts.split)
        self.engine, self.tokenizer, self.settings = load_engine(
            self.opts.model, self.opts.engine, self.opts.device, max_batch_prompts=max(1, self.opts.max_batch_size),
            max_tokens=self.opts.max_tokens, engine_kwargs=self.opts.engine_kwargs)
        sv, style = int(self.settings["sample_values"]), self.settings["prompt_style"]
        self.schemas = {db: read_schema(path, sv) for db, path in self.dbs.items()}
        self.schema_texts = {db: schema_text(s, style, sv) for db, s in self.schemas.items()}
        self.pool = SqlPool(workers=self.opts.sql_workers, timeout_s=self.opts.sql_timeout_s,
                            max_rows=self.opts.sql_max_rows, memory_mb=1024)
        self.generate_batch.set_max_batch_size(max(1, self.opts.max_batch_size))
        self.generate_batch.set_batch_wait_timeout_s(self.opts.batch_wait_s)
        self.ids = itertools.count()
        self.counters = {"requests": 0, "batches": 0, "batched_requests": 0, "max_batch": 0}
        self.log.info("serve.ready", model=self.opts.model, databases=len(self.dbs), style=style,
                      max_batch_size=self.opts.max_batch_size, pid=os.getpid())

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
        out: dict[str, Any] = {"execute_s": round(time.perf_counter() - t, 4)}
        if r.status == "ok":
            out.update(verdict="ok", error="", row_count=len(r.rows), truncated=len(r.rows) > self.opts.return_rows,
                       rows=[[json_value(v) for v in row] for row in r.rows[: self.opts.return_rows]])
        else:
            verdict = {"timeout": TIMEOUT, "too_many_rows": TOO_MANY_ROWS}.get(r.status, SQL_ERROR)
            out.update(verdict=verdict, error=r.error, row_count=0, truncated=False, rows=[])
        return out

    def _db(self, body: dict) -> str:
        db_id = field_of(body, "db_id", str)
        if db_id not in self.dbs:
            raise RequestError(404, f"unknown db_id {db_id!r} (GET /v1/databases lists {len(self.dbs)})")
        return db_id

    # -- routes ----------------------------------------------------------------------------------

    @app.post("/v1/sql")
    async def sql(self, request: Request) -> JSONResponse:
        from actors.engines.base import TaskError
        from policies.sql_reward import GENERATION_ERROR, NO_SQL, extract_sql

        start = time.perf_counter()
        body = await read_json(request)
        question = field_of(body, "question", str, max_chars=self.opts.max_question_chars)
        db_id = self._db(body)
        evidence = field_of(body, "evidence", str, required=False, max_chars=self.opts.max_evidence_chars) or ""
        execute = bool(field_of(body, "execute", bool, required=False))
        max_turns = field_of(body, "max_turns", int, required=False) or 1
        if not 1 <= max_turns <= MAX_TURNS:
            raise RequestError(422, f"field 'max_turns' must be in 1..{MAX_TURNS}, got {max_turns}")
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
                               "finish_reason": sample.finish_reason, "batch_size": batch}
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
                timings["execute_s"] = result.pop("execute_s")
                out.update(result)
        timings["total_s"] = round(time.perf_counter() - start, 4)
        out["timings"] = timings
        self.log.info("serve.sql", db_id=db_id, batch=batch, verdict=out.get("verdict"), **timings)
        return JSONResponse(out)

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
        return JSONResponse({**self.counters, **self.engine.stats(), "sql_queries": self.pool.queries})

    @app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.opts.model, "databases": len(self.dbs)})

    @app.get("/")
    async def page(self) -> HTMLResponse:
        from launch.serve_page import PAGE

        return HTMLResponse(PAGE)


def build_app(opts: ServeOptions, replicas: int = 1, actor_options: dict | None = None, max_ongoing: int = 64):
    return SqlService.options(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                              ray_actor_options=actor_options or {"num_cpus": 1.0}).bind(asdict(opts))


def start(opts: ServeOptions, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
          actor_options: dict | None = None, timeout_s: float = 600.0) -> str:
    """Deploys the app on the connected Ray cluster and waits (bounded) until it answers; returns its URL."""
    import concurrent.futures

    serve.start(http_options={"host": host, "port": port, "request_timeout_s": opts.request_timeout_s + 60})
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(serve.run, build_app(opts, replicas, actor_options), name=APP_NAME, route_prefix="/")
    try:
        fut.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"the service was not ready after {timeout_s:g} s (see the Ray logs)") from None
    finally:
        pool.shutdown(wait=False)
    return f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    from observe.logs import quiet_cpu_host

    quiet_cpu_host()
    p = argparse.ArgumentParser(prog="python -m launch.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face export, e.g. runs/<run>/hf/step_<N>")
    p.add_argument("--bird-dir", required=True, help="holds <split>_databases/<db_id>/<db_id>.sqlite")
    p.add_argument("--split", default="dev")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="the HTTP proxy's address (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--batch-wait-s", type=float, default=0.02)
    p.add_argument("--max-tokens", type=int, default=0, help="new tokens per answer (0: the export's)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--gpus-per-replica", type=float, default=None, help="default 1 with vllm, 0 otherwise")
    p.add_argument("--ray-address", default="", help="join this cluster (default: start our own, local)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    from launch.export import ExportError, default_engine, read_settings

    try:
        if args.replicas < 1 or args.max_batch_size < 1 or not 0 < args.port < 65536:
            raise ValueError("--replicas and --max-batch-size must be >= 1 and --port in 1..65535")
        read_settings(args.model)
        dbs = find_databases(args.bird_dir, args.split)
    except (ExportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import tempfile

    import ray

    engine = args.engine or default_engine()  # decided here: a replica without a GPU would not see one

    temp_dir = None if args.ray_address else tempfile.mkdtemp(prefix="arl-serve-ray-")
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        ray.init(address="local", include_dashboard=False, _temp_dir=temp_dir)
    opts = ServeOptions(model=str(Path(args.model).resolve()), bird_dir=str(Path(args.bird_dir).resolve()),
                        split=args.split, engine=engine, device=args.device, max_batch_size=args.max_batch_size,
                        batch_wait_s=args.batch_wait_s, max_tokens=args.max_tokens)
    try:
        actor_options = {"num_cpus": args.cpus_per_replica}
        gpus = args.gpus_per_replica if args.gpus_per_replica is not None else float(engine == "vllm")
        if gpus:
            actor_options["num_gpus"] = gpus
        url = start(opts, args.host, args.port, args.replicas, actor_options, args.start_timeout)
        db = next(iter(dbs))
        print(f"serving {args.model} on {url} ({len(dbs)} databases, {args.replicas} replica(s)); Ctrl-C stops\n"
              f"  page:  {url}/\n"
              f"  ask:   curl -s {url}/v1/sql -d '{{\"db_id\": \"{db}\", \"question\": \"How many rows?\", "
              f"\"execute\": true}}'", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()
        if temp_dir is not None:
            import shutil

            shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
