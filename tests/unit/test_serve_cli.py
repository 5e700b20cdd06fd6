"""launch.serve's checks that need no service: the CLI's bad input exits 2 with one line before Ray is even imported
(the unit lane's guard fails a test that imports Ray: launch/serve.py keeps Ray Serve's application, launch/serve_app.py,
behind its checks), and the rules an API key and a host are held to (launch.serve_http)."""
import base64

import pytest


@pytest.mark.parametrize("args, key, message", [
    (["--model", "{tmp}"], None, "has no config.json"),
    (["--model", "{model}", "--split", "nope"], None, "databases directory not found"),
    (["--model", "{model}", "--replicas", "0"], None, "--replicas and --max-batch-size must be >= 1"),
    (["--model", "{model}", "--sql-workers", "9"], None, "--sql-workers must be >= 1 and at most --sql-max-workers"),
    # beyond loopback without a key: refused first, before the (missing) export is even looked at
    (["--model", "/no/such/export", "--host", "0.0.0.0"], None, "--host 0.0.0.0 is not loopback"),
    (["--model", "/no/such/export", "--host", "192.0.2.7"], None, "set an API key (ARL_API_KEY, or --api-key)"),
    (["--model", "/no/such/export", "--host", "example.org"], None, "--host example.org is not loopback"),
    (["--model", "/no/such/export", "--host", "0.0.0.0", "--api-key", " "], None, "the API key is empty"),
    (["--model", "/no/such/export", "--host", "0.0.0.0"], "", "the API key is empty"),
    # with a key (flag or ARL_API_KEY), or on loopback, the next check speaks
    (["--model", "/no/such/export", "--host", "0.0.0.0", "--api-key", "s3cret"], None, "/no/such/export"),
    (["--model", "/no/such/export", "--host", "0.0.0.0"], "s3cret", "/no/such/export"),
    (["--model", "/no/such/export", "--host", "::1"], None, "/no/such/export"),
    (["--model", "/no/such/export", "--host", "localhost"], None, "/no/such/export"),
])
def test_cli_bad_input_exits_2_before_importing_ray(tmp_path, capsys, monkeypatch, args, key, message):
    from launch.serve import main

    if key is None:
        monkeypatch.delenv("ARL_API_KEY", raising=False)
    else:
        monkeypatch.setenv("ARL_API_KEY", key)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    fill = {"{tmp}": str(tmp_path), "{model}": str(tmp_path / "m")}
    assert main([fill.get(a, a) for a in args] + ["--bird-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_auth_rules_without_a_service():
    """No key: every request passes (the service is on loopback then); with one, only the key does."""
    from launch.serve_http import auth_refusal, host_refusal, is_loopback, key_digest

    assert auth_refusal("", None) == "" and auth_refusal(key_digest(None), "Bearer anything") == ""
    digest = key_digest("s3cret")
    assert digest and "s3cret" not in digest
    assert auth_refusal(digest, "Bearer s3cret") == "" and auth_refusal(digest, "bearer  s3cret ") == ""
    assert auth_refusal(digest, "Basic " + base64.b64encode(b"me:s3cret").decode()) == ""
    assert auth_refusal(digest, "Bearer s3cret2") == "wrong API key"
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.org", "")] == [False] * 5
    assert host_refusal("127.0.0.1", None) == "" and host_refusal("0.0.0.0", "k") == ""


def test_a_request_without_max_turns_gets_the_turns_the_model_trained_with():
    """A model trained on look-then-fix episodes (its export's max_turns 3) is asked as it trained unless the
    request says otherwise: from the single-turn prompt it never saw it may write no SQL at all (seen: a
    tiny_look export answered "'" to every dev question at 1 turn, the right rows at 3)."""
    from launch.serve_http import MAX_TURNS, RequestError, request_turns

    assert [request_turns(body, 3) for body in ({}, {"max_turns": None}, {"max_turns": 0})] == [3, 3, 3]
    assert request_turns({}, 1) == 1 and request_turns({}, 0) == 1 and request_turns({}, 99) == MAX_TURNS
    assert request_turns({"max_turns": 1}, 3) == 1 and request_turns({"max_turns": 5}, 1) == 5
    for bad, reason in ((99, "must be in 1..8"), (-1, "must be in 1..8"), ("3", "must be an integer"), (True, "must be an integer")):
        with pytest.raises(RequestError, match=reason):
            request_turns({"max_turns": bad}, 3)


def test_the_first_interrupt_raises_and_a_second_on_its_heels_is_ignored():
    """Seen: a SIGINT sent to the CLI and passed on again by a wrapper raised a second KeyboardInterrupt on the
    way into `stop` (a traceback, the clean-up cut short)."""
    import os
    import signal

    from launch.serve_life import interrupt_on_sigterm

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        interrupt_on_sigterm()
        for first in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), first)
                signal.sigtimedwait([], 0.001)  # lets the handler run here
            try:
                os.kill(os.getpid(), signal.SIGINT)  # the second: ignored
                os.kill(os.getpid(), signal.SIGTERM)
                signal.sigtimedwait([], 0.001)
            except KeyboardInterrupt:
                pytest.fail(f"a second signal after {first.name} raised KeyboardInterrupt again")
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            interrupt_on_sigterm()
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
