"""launch.serve for real: a local Ray, Ray Serve's HTTP proxy, the tiny export, SQLite, an HTTP client.

One Serve application serves every test here (module fixture), with an API key: every route but
/healthz needs it (401 with one line otherwise), concurrent requests are batched (the test counts
engine batches < requests), SQL runs read-only, runaway queries do not make a trivial one wait, each
bad input is a 4xx with a one-line reason under "error" (unknown routes and methods too), the proxy
listens on loopback only, the page loads, and the `openai` client gets the SQL and its rows from
/v1/chat/completions.
"""
import base64
import concurrent.futures
import hashlib
import json
import os
import shutil
import socket
import time

import pytest

from tests.clusters import ray_cluster
from tests.net import free_port
from tests.tiny_export import build

httpx = pytest.importorskip("httpx")

KEY = "k3y-for-the-serve-tests"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    pytest.importorskip("ray")
    from ray import serve

    from launch.serve_app import ServeOptions, start
    from launch.serve_http import key_digest

    model, bird = build(tmp_path_factory.mktemp("serve"))
    with ray_cluster("ray-serve-test-"):
        try:
            opts = ServeOptions(model=str(model), bird_dir=str(bird), engine="transformers", device="cpu",
                                max_batch_size=8, batch_wait_s=0.2, sql_timeout_s=8.0, sql_workers=1,
                                sql_max_workers=6, api_key_sha256=key_digest(KEY))
            url = start(opts, "127.0.0.1", free_port(), replicas=1, actor_options={"num_cpus": 1}, timeout_s=300)
            with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
                yield client, model, bird
        finally:
            serve.shutdown()


def test_health_databases_and_page(service):
    client, _, _ = service
    r = client.get("/healthz")  # the health app's answer: this cluster's proxy was not started with ours
    assert r.headers["x-arl-healthz"] == "replica"
    health = r.json()
    assert health["status"] == "ok" and health["replicas"] == {"RUNNING": 1} and health["databases"] == 2
    # the model replica and its SQL workers run 10 nice levels below the proxy (launch/serve_life.py)
    assert client.get("/v1/stats").json()["nice"] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    assert client.post("/healthz").status_code == 405
    dbs = client.get("/v1/databases").json()["databases"]
    assert len(dbs) == 2 and all(d["tables"] and d["tables"][0]["columns"] for d in dbs)
    page = client.get("/")
    assert page.status_code == 200 and '<select id="db">' in page.text
    assert '<input type="number" id="turns"' in page.text and "max_turns: Number($('turns').value)" in page.text
    assert 'showEpisode(data)' in page.text and '<div id="episode">' in page.text


def test_concurrent_questions_are_batched_and_executed(service):
    from tasks.bird import load_split

    client, _, bird = service
    questions = load_split(bird, "dev")[:8]
    before = client.get("/v1/stats").json()

    def ask(q):
        return client.post("/v1/sql", json={"question": q.question, "db_id": q.db_id, "evidence": q.evidence,
                                            "execute": True})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, questions))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    bodies = [r.json() for r in replies]
    after = client.get("/v1/stats").json()
    served = after["requests"] - before["requests"]
    assert served == 8
    assert after["batches"] - before["batches"] < served  # @serve.batch collected several requests per call
    assert after["engine_batches"] - before["engine_batches"] < served  # ... and the engine decoded them together
    assert max(b["batch_size"] for b in bodies) > 1
    ok = [b for b in bodies if b["verdict"] == "ok"]
    assert ok and all(b["sql"] and b["rows"] and set(b["timings"]) == {"generate_s", "queue_wait_s", "execute_s",
                                                                      "total_s"} for b in ok)


def test_max_turns_returns_every_turn_and_the_final_sql(service):
    from tasks.bird import load_split

    client, _, bird = service
    q = load_split(bird, "dev")[0]
    r = client.post("/v1/sql", json={"question": q.question, "db_id": q.db_id, "max_turns": 3, "execute": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert 1 <= body["turns"] <= 3 and isinstance(body["queries"], list) and "tool_errors" in body
    assert "verdict" in body


def test_sql_runs_read_only(service):
    client, _, _ = service
    db = client.get("/v1/databases").json()["databases"][0]
    table = db["tables"][0]["name"]
    from launch.serve_http import find_databases

    path = find_databases(service[2], "dev")[db["db_id"]]
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    count = client.post("/v1/execute", json={"db_id": db["db_id"], "sql": f"SELECT COUNT(*) FROM {table}"}).json()
    assert count["verdict"] == "ok" and count["rows"][0][0] > 0
    for sql in (f"DELETE FROM {table}", f"DROP TABLE {table}", "ATTACH DATABASE '/tmp/x.db' AS x"):
        r = client.post("/v1/execute", json={"db_id": db["db_id"], "sql": sql})
        assert r.status_code == 200 and r.json()["verdict"] == "sql_error", r.text
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest
    again = client.post("/v1/execute", json={"db_id": db["db_id"], "sql": f"SELECT COUNT(*) FROM {table}"}).json()
    assert again["rows"] == count["rows"]


@pytest.mark.parametrize("path, body, status, reason", [
    ("/v1/sql", b"{not json", 400, "not valid JSON"),
    ("/v1/sql", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/sql", {"db_id": "DB"}, 422, "missing field 'question'"),
    ("/v1/sql", {"question": "How many?"}, 422, "missing field 'db_id'"),
    ("/v1/sql", {"question": 7, "db_id": "DB"}, 422, "field 'question' must be a string"),
    ("/v1/sql", {"question": "How many?", "db_id": "DB", "execute": "yes"}, 422, "field 'execute' must be a boolean"),
    ("/v1/sql", {"question": "How many?", "db_id": "no_such_db"}, 404, "unknown db_id 'no_such_db'"),
    ("/v1/sql", {"question": "x" * 3000, "db_id": "DB"}, 422, "field 'question' is 3000 characters"),
    ("/v1/sql", {"question": "y" * 70_000, "db_id": "DB"}, 413, "the limit is 65536"),
    ("/v1/execute", {"db_id": "DB"}, 422, "missing field 'sql'"),
    ("/v1/sql", {"question": "How many?", "db_id": "DB", "max_turns": "3"}, 422, "field 'max_turns' must be an integer"),
    ("/v1/sql", {"question": "How many?", "db_id": "DB", "max_turns": 99}, 422, "field 'max_turns' must be in 1..8"),
])
def test_bad_input_is_a_4xx_with_one_line(service, path, body, status, reason):
    client, _, _ = service
    db = client.get("/v1/databases").json()["databases"][0]["db_id"]
    if isinstance(body, dict):
        r = client.post(path, json={k: (db if v == "DB" else v) for k, v in body.items()})
    else:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert reason in error and "\n" not in error and "Traceback" not in r.text


def test_openai_client_lists_models_and_gets_the_sql_with_its_rows(service):
    """The `openai` package against the running server: /v1/models, a chat completion whose content is
    the SQL /v1/sql gives for the same question, the rows beside it, the database by field or suffix."""
    openai = pytest.importorskip("openai")
    from tasks.bird import load_split

    client, _, bird = service
    oa = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ids = {m.id for m in oa.models.list()}
    q = load_split(bird, "dev")[0]
    assert {"arl-sql", f"arl-sql/{q.db_id}"} <= ids
    messages = [{"role": "system", "content": "Answer in SQL."}, {"role": "user", "content": q.question}]
    by_suffix = oa.chat.completions.create(model=f"arl-sql/{q.db_id}", messages=messages)
    by_field = oa.chat.completions.create(model="arl-sql", messages=messages, extra_body={"db_id": q.db_id})
    ours = client.post("/v1/sql", json={"question": q.question, "db_id": q.db_id, "execute": True}).json()
    for r in (by_suffix, by_field):
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == (ours["sql"] or "")
        assert r.verdict == ours["verdict"] and r.rows == ours["rows"] and r.usage.completion_tokens > 0
    assert by_suffix.model_extra.get("columns") == ours.get("columns")
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=f"arl-sql/{q.db_id}", messages=messages, stream=True)
    assert "stream is not supported" in str(e.value.body)  # the client hands back the body's "error"
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=messages)
    stranger = openai.OpenAI(base_url=str(oa.base_url), api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        stranger.chat.completions.create(model=f"arl-sql/{q.db_id}", messages=messages)
    assert e.value.status_code == 401 and "wrong API key" in str(e.value.body)


@pytest.mark.parametrize("method, path, body, status, reason", [
    ("POST", "/v1/chat/completions", {"model": "arl-sql", "messages": [{"role": "user", "content": "How many?"}]},
     422, "name the database"),
    ("POST", "/v1/chat/completions", {"model": "arl-sql/DB", "messages": []}, 422, "field 'messages'"),
    ("POST", "/v1/chat/completions", {"model": "arl-sql/DB", "messages": [{"role": "user", "content": "x"}],
                                      "stream": True}, 400, "stream is not supported"),
    ("POST", "/v1/chat/completions", {"model": "arl-sql/nope", "messages": [{"role": "user", "content": "x"}]},
     404, "unknown db_id 'nope'"),
    ("GET", "/v1/nowhere", None, 404, "Not Found: GET /v1/nowhere"),
    ("GET", "/v1/sql", None, 405, "Method Not Allowed"),
])
def test_every_error_body_is_one_line_under_error(service, method, path, body, status, reason):
    client, _, _ = service
    db = client.get("/v1/databases").json()["databases"][0]["db_id"]
    if body is not None:
        body = json.loads(json.dumps(body).replace("arl-sql/DB", f"arl-sql/{db}"))
    r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and reason in r.json()["error"] and "\n" not in r.json()["error"]


def test_rows_carry_column_names(service):
    client, _, _ = service
    db = client.get("/v1/databases").json()["databases"][0]
    table = db["tables"][0]["name"]
    r = client.post("/v1/execute", json={"db_id": db["db_id"], "sql": f"SELECT COUNT(*) AS n, 1 AS one FROM {table}"})
    assert r.json()["columns"] == ["n", "one"]


def test_proxy_listens_on_loopback_only(service):
    psutil = pytest.importorskip("psutil")
    client, _, _ = service
    port = client.base_url.port
    addrs = [a.address for nic in psutil.net_if_addrs().values() for a in nic
             if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not addrs:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    for addr in addrs:
        with pytest.raises(OSError), socket.create_connection((addr, port), timeout=2):
            pass


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_page_in_headless_chromium_answers_a_typed_question(service, tmp_path):
    """Types a dev question into the page over the DevTools protocol, clicks Ask, reads the SQL shown
    and checks a screenshot (kept under tmp_path, never committed)."""
    import asyncio
    import subprocess

    aiohttp = pytest.importorskip("aiohttp")
    image = pytest.importorskip("PIL.Image")
    binary = _chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    from tasks.bird import load_split

    client, _, bird = service
    q = load_split(bird, "dev")[0]
    profile = tmp_path / "profile"
    proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                             f"--user-data-dir={profile}", "--window-size=1000,800", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        port_file = profile / "DevToolsActivePort"
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and proc.poll() is None, "chromium did not open its DevTools port"
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])

        async def drive() -> tuple[str, bytes]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                targets = await (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
                ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
                async with http.ws_connect(ws_url, max_msg_size=0) as ws:
                    ids = iter(range(1, 10_000))

                    async def cdp(method, **params):
                        i = next(ids)
                        await ws.send_json({"id": i, "method": method, "params": params})
                        while True:
                            msg = await asyncio.wait_for(ws.receive_json(), 30)
                            if msg.get("id") == i:
                                assert "error" not in msg, msg
                                return msg["result"]

                    async def js(expr):
                        return (await cdp("Runtime.evaluate", expression=expr, returnByValue=True))["result"].get("value")

                    async def until(expr, what, seconds=60.0):
                        end = time.monotonic() + seconds
                        while not await js(expr):
                            assert time.monotonic() < end, f"the page never showed {what}"
                            await asyncio.sleep(0.2)

                    basic = base64.b64encode(f"arl:{KEY}".encode()).decode()  # what a browser sends after its prompt
                    await cdp("Network.enable")
                    await cdp("Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {basic}"})
                    await cdp("Page.navigate", url=str(client.base_url) + "/")
                    await until("document.querySelectorAll('#db option').length > 1", "the database list")
                    await js(f"document.getElementById('db').value = {q.db_id!r}; "
                             "document.getElementById('db').dispatchEvent(new Event('change'))")
                    for box_id, text in (("question", q.question), ("evidence", q.evidence)):
                        await js(f"document.getElementById({box_id!r}).focus()")
                        await cdp("Input.insertText", text=text)
                    box = await js("JSON.stringify(document.getElementById('ask').getBoundingClientRect())")
                    import json

                    r = json.loads(box)
                    x, y = r["x"] + r["width"] / 2, r["y"] + r["height"] / 2
                    for kind in ("mousePressed", "mouseReleased"):
                        await cdp("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
                    await until("document.getElementById('status').textContent === 'done'", "an answer")
                    sql = await js("document.getElementById('sql').textContent")
                    # the result table's header is the columns (the page's own function, on a known result)
                    header = await js("Array.from(table([[1, null]], ['n', 'city']).querySelectorAll('th'))"
                                      ".map((th) => th.textContent).join('|')")
                    shot = await cdp("Page.captureScreenshot", format="png")
                    return sql, header, base64.b64decode(shot["data"])

        sql, header, png = asyncio.run(drive())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert sql.strip().upper().startswith("SELECT"), sql
    assert header == "n|city"
    path = tmp_path / "page.png"
    path.write_bytes(png)
    img = image.open(path).convert("L")
    assert img.size[0] >= 800 and img.size[1] >= 600
    dark = sum(1 for v in img.getdata() if v < 100)  # text drawn on the white page
    assert dark > 500, f"the screenshot looks blank ({dark} dark pixels): {path}"


@pytest.mark.parametrize("method, path", [
    ("GET", "/"), ("GET", "/v1/databases"), ("GET", "/v1/stats"), ("GET", "/v1/models"), ("POST", "/v1/sql"),
    ("POST", "/v1/execute"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nowhere"), ("GET", "/v1/sql"),
    ("GET", "/healthz/anything"),  # under the health app's prefix: the key rule holds there too
])
def test_every_route_but_healthz_needs_the_key(service, method, path):
    """Without the key, with a wrong one or another scheme: 401 with one line under "error", before the
    route runs (the unknown route and the wrong method too). /healthz stays open for probes."""
    client, _, _ = service
    base = str(client.base_url)
    body = {"db_id": "x", "question": "q", "sql": "SELECT 1"} if method == "POST" else None
    for headers, reason in (({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "wrong API key"),
                            ({"Authorization": f"Token {KEY}"}, "unsupported authorization scheme"),
                            ({"Authorization": "Basic !!"}, "malformed Basic credentials")):
        r = httpx.request(method, base + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert set(r.json()) == {"error"} and reason in r.json()["error"] and "\n" not in r.json()["error"]
        assert r.headers["www-authenticate"] == ('Basic realm="arl-sql"' if path == "/" else "Bearer")
    assert httpx.get(base + "/healthz", timeout=60).json()["status"] == "ok"
    assert httpx.get(base + "/healthz/anything", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 404
    basic = "Basic " + base64.b64encode(f"anyone:{KEY}".encode()).decode()  # a browser after its login prompt
    assert httpx.get(base + "/v1/databases", headers={"Authorization": basic}, timeout=60).status_code == 200


def test_runaway_queries_do_not_make_a_trivial_select_wait(service):
    """Three endless queries (each ends at the 8 s deadline) and then a trivial SELECT: the SELECT is
    answered while all three still run (the replica's sandbox pool grew past its one worker), and its
    body reports queue_wait_s apart from execute_s."""
    client, _, _ = service
    db = client.get("/v1/databases").json()["databases"][0]
    table = db["tables"][0]["name"]
    endless = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runaway = [pool.submit(client.post, "/v1/execute", json={"db_id": db["db_id"], "sql": endless})
                   for _ in range(3)]
        deadline = time.monotonic() + 60
        while client.get("/v1/stats").json()["sql_workers"] < 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # the three are running: the pool started a spare beside them
        trivial = client.post("/v1/execute", json={"db_id": db["db_id"], "sql": f"SELECT COUNT(*) AS n FROM {table}"})
        still_running = [not f.done() for f in runaway]
        bodies = [f.result().json() for f in runaway]
    assert trivial.status_code == 200 and trivial.json()["verdict"] == "ok", trivial.text
    assert all(still_running), "the trivial SELECT waited for a runaway query to end"
    assert {"queue_wait_s", "execute_s"} <= set(trivial.json()) and trivial.json()["columns"] == ["n"]
    assert [b["verdict"] for b in bodies] == ["timeout"] * 3
    assert client.get("/v1/stats").json()["sql_peak_workers"] >= 4
