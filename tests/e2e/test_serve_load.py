"""The service-under-load bench in seconds: `python -m bench.serve.load` against `python -m launch.serve`
(started as a user starts it) on the tests' tiny export, half of a few clients hostile.

Every answer must be below 500, no request may fail on the client side (a timeout, a dropped
connection), and every hostile request (endless CTEs, writes, stacked statements, ATTACH, huge results,
a body over the cap, an over-long question, bad JSON, an unknown database) is answered with a 4xx or a
200 whose verdict says the sandbox refused or cut it. The 64-client, 5-minute figures are in
docs/reliability/serve.md.
"""
from __future__ import annotations

import json

import pytest

from bench.serve import load as serve_load


@pytest.mark.slow  # builds the tiny export and starts the service with its own Ray
def test_hostile_clients_get_4xx_or_a_refusal_never_a_5xx(tmp_path):
    out = tmp_path / "load.json"
    rc = serve_load.main(["--clients", "6", "--hostile-fraction", "0.5", "--seconds", "20", "--replicas", "1",
                          "--work-dir", str(tmp_path), "--json", str(out)])
    r = json.loads(out.read_text())["results"][0]
    assert r["server_errors"] == [] and r["client_errors"] == [], (r["server_errors"], r["client_errors"])
    assert r["problems"] == [] and r["service_rc"] == 0, r["problems"]
    answers = {k: v for k, v in r["hostile"].items()}
    assert len(answers) >= 6, answers  # several kinds of hostile request were answered
    assert any(key.startswith("4") for v in answers.values() for key in v), answers  # the malformed: 4xx
    assert any(key.startswith("200 ") for v in answers.values() for key in v), answers  # hostile SQL: refused
    assert r["routes"]["POST /v1/sql"]["status"] == {"200": r["routes"]["POST /v1/sql"]["n"]}
    assert r["healthz"]["n"] > 0 and r["healthz"]["failures"] == []
    assert set(r["healthz"]["answered_by"]) == {"proxy"}, r["healthz"]  # the CLI's proxy answers it, no replica
    assert rc == 0
