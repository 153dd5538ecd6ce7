"""``batch-llm serve`` over HTTP (issue 19): uvicorn in a thread on 127.0.0.1, a free port, a fast
simulated GPU; driven with the official ``openai`` client and raw ``httpx``.

Tests assert behaviour, never timings, except the A/B fairness ratio the issue names.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batch import commands  # noqa: E402
from batch.server import bench_serve  # noqa: E402
from batch.server.app import ServerConfig, create_app  # noqa: E402
from batch.server.engine import Engine, SeededGPU  # noqa: E402
from batch.server.serve import build_engine, load_config  # noqa: E402
from batch.server.tokenizer import WordTokenizer  # noqa: E402
from spec.invariants import InvariantViolation  # noqa: E402
from scheduler import Scheduler  # noqa: E402

MODEL = "batch-sim"
ROOT = Path(__file__).resolve().parent.parent


class LiveServer:
    """``batch-llm serve``'s app under uvicorn in a daemon thread, on a socket bound to a free port.

    Args:
        cfg: the HTTP settings; **engine_kw: ``build_engine`` arguments (``time_scale``, ...).
    """

    def __init__(self, cfg: ServerConfig | None = None, engine=None, **engine_kw) -> None:
        engine_kw.setdefault("time_scale", 0.05)
        if engine is None:
            self.engine, tok, name = build_engine(**engine_kw)
        else:
            self.engine, tok, name = engine, WordTokenizer(), MODEL
        cfg = cfg or ServerConfig()
        cfg.model_name = name
        cfg.seed_by_prompt = engine_kw.get("backend", "sim") == "sim"
        self.app = create_app(self.engine, tok, cfg)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        # the engine ran checked (conftest), and no spec check failed in its thread
        assert self.engine.scheduler._checker is not None
        assert not isinstance(self.engine.error, InvariantViolation), self.engine.error

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()

    def drained(self, timeout_s: float = 20.0) -> dict:
        """Wait until nothing is in flight; the last ``/health``."""
        return bench_serve.wait_drained(self.url, timeout_s)

    def openai(self, api_key: str = "test-key") -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def srv():
    with LiveServer(ServerConfig(trust_user_field=True), seed=7) as s:  # the body's user is the identity
        yield s


def _metric(url: str, series: str) -> float:
    return bench_serve.scrape(url).get(series, 0.0)


def _assert_idle(h: dict) -> None:
    assert h["in_flight"] == 0 and h["kv_blocks_used"] == 0 and h["running"] == h["waiting"] == 0, h
    assert h["submitted"] == h["finished"] + h["aborted"], h


# ---------------------------------------------------------------- the API


def test_models_health_metrics(srv):
    assert [m.id for m in srv.openai().models.list()] == [MODEL]
    h = srv.health()
    assert h["status"] == "ok" and h["engine_alive"] and h["kv_cap_blocks"] == 256
    text = httpx.get(f"{srv.url}/metrics").text
    for name in ("batch:time_to_first_token_seconds_bucket", "batch:inter_token_latency_seconds_bucket",
                 "batch:e2e_request_latency_seconds_bucket", "batch:request_queue_time_seconds_bucket",
                 "batch:num_requests_running", "batch:num_requests_waiting", "batch:kv_cache_usage_perc",
                 "batch:requests_in_flight"):
        assert name in text, name


def test_stream_matches_non_stream_with_the_openai_client(srv):
    client = srv.openai()
    prompt = "the quick brown fox jumps over the lazy dog"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
    pieces, reasons = [], []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stream=True):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == full.choices[0].text != ""
    assert reasons[-1] == full.choices[0].finish_reason in ("stop", "length") and set(reasons[:-1]) == {None}
    words = full.choices[0].text.split()
    assert [p.strip() for p in pieces if p] == words  # one token per chunk, in order
    assert full.usage.prompt_tokens == 9 and full.usage.completion_tokens >= len(words)

    msgs = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=25)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=25, stream=True))
    assert streamed == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"


def test_raw_sse_format_and_usage(srv):
    body = {"prompt": "a b c", "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3
    tokens = chunks[:-1]
    assert tokens[-1]["choices"][0]["finish_reason"] is not None
    assert usage["usage"]["completion_tokens"] == len(tokens)  # one chunk per token, EOS included


KEYS = {"sk-alice-1": "alice", "sk-bob-1": "bob"}


def _record_users(s: LiveServer) -> list[str]:
    """The fairness identity of every request the app submits to the engine, in order."""
    seen: list[str] = []
    submit = s.engine.submit
    s.engine.submit = lambda req, stream=True: (seen.append(req.user_id), submit(req, stream))[1]
    return seen


def _assert_401(r) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert "sk-" not in err["message"]  # a key is never echoed


def test_with_keys_no_key_a_wrong_key_or_basic_auth_get_401_on_every_v1_route():
    with LiveServer(ServerConfig(api_keys=KEYS, max_body_bytes=1000)) as s:
        seen = _record_users(s)
        routes = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                  ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})]
        bad_headers = [{}, {"Authorization": "Bearer sk-mallory"}, {"Authorization": "Bearer sk-alice-1x"},
                       {"Authorization": "Bearer SK-ALICE-1"}, {"Authorization": "Basic c2stYWxpY2UtMTo="},
                       {"Authorization": "sk-alice-1"}, {"Authorization": "Bearer"}, {"X-Api-Key": "sk-alice-1"}]
        for method, path, body in routes:
            for headers in bad_headers:
                _assert_401(httpx.request(method, f"{s.url}{path}", json=body, headers=headers))
            ok = httpx.request(method, f"{s.url}{path}", json=body, headers={"Authorization": "Bearer sk-alice-1"})
            assert ok.status_code == 200, ok.text
        # the key is checked before the body is read: an oversized body without a key is a 401, not a 413
        _assert_401(httpx.post(f"{s.url}/v1/completions", content=b"x" * 5000,
                               headers={"content-type": "application/json"}))
        with pytest.raises(openai.AuthenticationError):
            s.openai("sk-made-up").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert s.openai("sk-bob-1").completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(f"{s.url}/health").status_code == 200  # open
        _assert_401(httpx.get(f"{s.url}/metrics"))  # with keys, /metrics needs one too by default
        metrics = httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer sk-bob-1"})
        assert metrics.status_code == 200 and "sk-" not in metrics.text
        m = bench_serve.scrape(s.url, headers={"Authorization": "Bearer sk-bob-1"})
    assert seen == ["alice", "alice", "bob"]  # nothing refused reached the engine
    assert m['batch:request_rejected_total{code="401"}'] == 3 * len(bad_headers) + 3
    assert not any(k.startswith("batch:request_rejected_total") and "413" in k for k in m)


def test_metrics_need_a_key_only_when_asked():
    with LiveServer(ServerConfig(api_keys=KEYS, metrics_need_key=True)) as s:
        _assert_401(httpx.get(f"{s.url}/metrics"))
        _assert_401(httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer sk-nobody"}))
        ok = httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer sk-bob-1"})
        assert ok.status_code == 200 and "batch:num_requests_running" in ok.text
        assert httpx.get(f"{s.url}/health").status_code == 200
    with pytest.raises(ValueError, match="needs api_keys"):
        LiveServer(ServerConfig(metrics_need_key=True))


def test_with_keys_the_identity_is_the_keys_user_whatever_the_body_says():
    with LiveServer(ServerConfig(api_keys=KEYS)) as s:
        seen = _record_users(s)
        for i in range(4):
            s.openai("sk-bob-1").completions.create(model=MODEL, prompt="x", max_tokens=2, user=f"rnd{i}")
        s.openai("sk-alice-1").chat.completions.create(model=MODEL, max_tokens=2, user="bob",
                                                       messages=[{"role": "user", "content": "x"}])
        s.openai("sk-alice-1").completions.create(model=MODEL, prompt="x", max_tokens=2)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "alice"})
        _assert_401(r)  # naming a user is no key
        m = bench_serve.scrape(s.url, headers={"Authorization": "Bearer sk-bob-1"})
    assert seen == ["bob"] * 4 + ["alice", "alice"]
    labelled = {k.split('"')[1] for k in m if k.startswith("batch:prompt_tokens_total{")}
    assert labelled == {"alice", "bob"}


@pytest.mark.parametrize("cfg, headers, body_user, identity", [
    (ServerConfig(), {}, "carol", "anonymous"),  # shared: nobody can claim an identity
    (ServerConfig(), {"Authorization": "Bearer sk-anything"}, None, "anonymous"),  # no keys configured: ignored
    (ServerConfig(trust_user_field=True), {}, "carol", "carol"),
    (ServerConfig(trust_user_field=True), {}, None, "anonymous"),
    (ServerConfig(user_header="X-Tenant-Id"), {"x-tenant-id": "acme"}, "carol", "acme"),  # the body is ignored
    (ServerConfig(user_header="X-Tenant-Id"), {}, "carol", "anonymous"),
], ids=["shared", "shared-key-ignored", "user-field", "user-field-absent", "header", "header-absent"])
def test_without_keys_the_identity_is_anonymous_unless_a_trusted_source_names_it(cfg, headers, body_user, identity):
    with LiveServer(cfg) as s:
        seen = _record_users(s)
        body = {"prompt": "x", "max_tokens": 2, **({"user": body_user} if body_user else {})}
        assert httpx.post(f"{s.url}/v1/completions", json=body, headers=headers).status_code == 200
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
                **({"user": body_user} if body_user else {})}
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=chat, headers=headers) as r:
            assert r.status_code == 200 and list(r.iter_lines())
    assert seen == [identity, identity]


def test_identity_options_that_conflict_or_overflow_are_refused(capsys):
    for cfg, match in ((ServerConfig(api_keys=KEYS, trust_user_field=True), "cannot be used with api_keys"),
                       (ServerConfig(api_keys=KEYS, user_header="x-tenant"), "cannot be used with api_keys"),
                       (ServerConfig(trust_user_field=True, user_header="x-tenant"), "together"),
                       (ServerConfig(user_header="x tenant"), "header name")):
        with pytest.raises(ValueError, match=match):
            LiveServer(cfg)
    from batch.server import serve
    for args in (["--trust-user-field", "--user-header", "x-t"], ["--metrics-auth"]):
        with pytest.raises(SystemExit) as e:
            serve.main(args)
        assert e.value.code == 2
    assert capsys.readouterr().err.count("batch-llm serve: error:") == 2
    with LiveServer(ServerConfig(trust_user_field=True)) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "user": "u" * 257})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "user": "u" * 256}).status_code == 200
    with LiveServer(ServerConfig(user_header="x-tenant")) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}, headers={"x-tenant": "t" * 257})
        assert r.status_code == 400 and "x-tenant" in r.json()["error"]["message"]


def test_config_files(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"weights": {"a": 2}}))
    assert load_config(j).weights == {"a": 2}
    for text, match in (('{"weights": {"a": 0}}', "int >= 1"), ('{"colour": 1}', "expected"), ("{", "JSON")):
        j.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_config(j)


# ---------------------------------------------------------------- disconnects, concurrency


def test_disconnect_aborts_and_frees_blocks():
    with LiveServer(eos_probability=0.0, time_scale=0.2) as s:
        before = s.health()["aborted"]
        body = {"prompt": "w " * 300, "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    assert s.health()["kv_blocks_used"] > 0
                    break  # leaving the block closes the connection mid-stream
        # a non-streaming request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json={"prompt": "z " * 100, "max_tokens": 3000}, timeout=0.3)
        h = s.drained()
        _assert_idle(h)
        assert h["aborted"] == before + 2
        assert s.engine.scheduler.pool.num_free == s.engine.scheduler.config.kv_cap_blocks
        assert _metric(s.url, 'batch:request_success_total{finished_reason="abort"}') == 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_closing_mid_body_is_a_499_with_one_log_line_not_a_server_error():
    # the client declares 1,000 bytes, sends 12 and closes: Starlette raises ClientDisconnect in
    # the body reader; the server counts a 499 (client closed request), logs one line, no traceback
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("batch.server", "uvicorn.error", "uvicorn")]
    with LiveServer(ServerConfig()) as s:
        for lg in loggers:
            lg.addHandler(records)
        try:
            host, port = s.url.removeprefix("http://").split(":")
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/completions"):
                with socket.create_connection((host, int(port))) as sk:
                    sk.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               f"Content-Length: 1000\r\n\r\n{{\"prompt\": \"".encode())
                    time.sleep(0.05)
            deadline = time.monotonic() + 20
            while _metric(s.url, 'batch:request_rejected_total{code="499"}') < 3:
                assert time.monotonic() < deadline, bench_serve.scrape(s.url)
                time.sleep(0.05)
            ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200  # the server goes on
            m = bench_serve.scrape(s.url)
        finally:
            for lg in loggers:
                lg.removeHandler(records)
    assert m['batch:request_rejected_total{code="499"}'] == 3
    assert not any(k.startswith("batch:request_rejected_total") and '"500"' in k for k in m)
    lines = [r for r in records.records if r.levelno >= logging.WARNING]
    assert len(lines) == 3 and all(r.name == "batch.server" and r.exc_info is None for r in lines), [
        (r.name, r.getMessage()) for r in lines]
    assert all("client closed" in r.getMessage() and "499" in r.getMessage() for r in lines)


def test_concurrent_users(srv):
    async def go():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            async def one(i):
                body = {"prompt": f"user {i % 4} request {i}", "max_tokens": 20, "user": f"cu{i % 4}",
                        "stream": i % 2 == 0}
                if body["stream"]:
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]"
                    return body["user"], len(lines) - 1
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200
                return body["user"], r.json()["usage"]["completion_tokens"]
            return await asyncio.gather(*(one(i) for i in range(24)))

    before = bench_serve.scrape(srv.url)
    results = asyncio.run(go())
    after = bench_serve.scrape(srv.url)
    for u in ("cu0", "cu1", "cu2", "cu3"):
        key = f'batch:generation_tokens_total{{user="{u}"}}'
        assert after[key] - before.get(key, 0) == sum(n for user, n in results if user == u)
    _assert_idle(srv.drained())


# ---------------------------------------------------------------- errors and backpressure


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"max_tokens": 5}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": 12}', "prompt"),
    (b'{"prompt": ["a", "b"]}', "prompt"),
    (b'{"prompt": "x", "stream": "yes please"}', "stream"),
    (b'{"prompt": "   "}', "prompt"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "x", "stream": 1}', "stream"),
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 2.0}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": NaN}', "max_tokens"),
    (b'{"prompt": [true, false]}', "prompt"),
    (b'{"prompt": [1.0, 2.0]}', "prompt"),
    (b'{"prompt": "x", "user": 5}', "user"),
    (b'{"prompt": "x", "model": 5}', "model"),
    # stream_options only with "stream": true (as vLLM); sampling parameters checked, then ignored
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": "x", "stream": false, "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}}', "stream_options"),
    (b'{"prompt": "x", "stream": true, "stream_options": 1}', "stream_options"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "temperature": true}', "temperature"),
    (b'{"prompt": "x", "temperature": 2.5}', "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "top_p": "1"}', "top_p"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "x", "presence_penalty": [0]}', "presence_penalty"),
    (b'{"prompt": "x", "frequency_penalty": -3}', "frequency_penalty"),
    (b'{"prompt": "x", "seed": 1.5}', "seed"),
    (b'{"prompt": "x", "logit_bias": {"5": "up"}}', "logit_bias"),
    (b'{"prompt": "x", "top_k": "all"}', "top_k"),
])
def test_bad_bodies_get_openai_errors(srv, body, param):
    r = httpx.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["code"] == 400


def test_bad_chat_bodies_and_unknown_model(srv):
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for body, param in (({"messages": [{"role": "user", "content": 5}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "3"},
                         "max_completion_tokens")):
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": None})
    assert ok.status_code == 200 and ok.json()["object"] == "text_completion"  # null: the default
    with pytest.raises(openai.NotFoundError):
        srv.openai().completions.create(model="gpt-9", prompt="x", max_tokens=2)
    err = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "model": "gpt-9"}).json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found" and err["param"] == "model"
    err = httpx.get(f"{srv.url}/nowhere").json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 404
    with pytest.raises(openai.BadRequestError):
        srv.openai().completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert httpx.get(f"{srv.url}/nowhere").json()["error"]["code"] == 404


def test_prompt_too_long_is_400_naming_the_limit(srv):
    with pytest.raises(openai.BadRequestError) as e:  # text: counting stops past the limit
        srv.openai().completions.create(model=MODEL, prompt="w " * 5000, max_tokens=5)
    assert e.value.status_code == 400 and "more than 4095 tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # token ids: counted
        srv.openai().completions.create(model=MODEL, prompt=[1] * 5000, max_tokens=5)
    assert e.value.status_code == 400 and "4095" in str(e.value) and "5000" in str(e.value)
    ok = srv.openai().completions.create(model=MODEL, prompt="w " * 4095, max_tokens=2)  # the limit itself fits
    assert ok.usage.prompt_tokens == 4095


def test_full_queue_is_429_with_retry_after():
    # max_waiting 1; each prompt needs most of the cache, so only one runs at a time and its
    # prefill takes 60 ticks: the others wait, and all but one of them are refused at once.
    with LiveServer(ServerConfig(max_waiting=1), time_scale=1.0) as s:
        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json={"prompt": f"p{i} " * 3800,
                                                                               "max_tokens": 2})
                                              for i in range(6)))
        rs = asyncio.run(go())
        codes = sorted(r.status_code for r in rs)
        assert codes.count(429) >= 1 and set(codes) <= {200, 429} and codes.count(200) >= 1
        busy = next(r for r in rs if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
        _assert_idle(s.drained())
        assert _metric(s.url, 'batch:request_rejected_total{code="429"}') == codes.count(429)


class _FailingGPU(SeededGPU):
    """The simulated GPU, failing every iteration whose batch holds a prompt starting with ``BAD``'s id."""

    BAD = WordTokenizer().encode("BAD")[0]

    def forward(self, batch):
        if any(r.prompt[0] == self.BAD and len(r.prompt) == 3 for r in batch):
            raise RuntimeError("device fault")
        return super().forward(batch)

    __call__ = forward  # SimulatedGPU binds __call__ to its own forward


def test_backend_failure_fails_the_batch_not_the_server():
    engine = Engine(Scheduler(backend=_FailingGPU(time_scale=0.05), max_backend_tries=3, record_itl=False))
    with LiveServer(engine=engine) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "BAD x y", "max_tokens": 5})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        with httpx.stream("POST", f"{s.url}/v1/completions",
                          json={"prompt": "BAD x y", "max_tokens": 5, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "error"
        ok = s.openai().completions.create(model=MODEL, prompt="fine", max_tokens=3)  # still serving
        assert ok.choices[0].finish_reason in ("stop", "length")
        h = s.drained()
        _assert_idle(h)
        # max_backend_tries=3: two failed ticks raise (rolled back, retried), the third fails the batch
        assert h["backend_errors"] == 4 and "device fault" in h["last_backend_error"]
        assert h["finish_reasons"]["error"] == 2


def test_engine_death_answers_503_and_fails_waiting_requests():
    with LiveServer() as s:
        def boom():
            raise RuntimeError("scheduler bug")
        s.engine.scheduler.tick = boom
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and "scheduler bug" in r.json()["error"]["message"]
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and h.json()["status"] == "error" and not h.json()["engine_alive"]
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}).status_code == 503


@pytest.mark.parametrize("kw", [{}, {"policy": "fcfs"}, {"policy": "round-robin"}, {"prefix_caching": True}])
def test_the_server_runs_with_the_spec_checks_on_in_the_test_suite(kw):
    """``build_engine`` follows ``Scheduler``'s default (on under ``tests/conftest.py``): the served
    ticks are checked, and the two tick checks validated them (with prefix caching neither models
    the tick: the state and block-content invariants ran, and the ticks are counted as skipped)."""
    with LiveServer(time_scale=0.01, **kw) as s:
        client = s.openai()
        system = " ".join(f"w{i}" for i in range(40))  # a shared prefix of two full blocks and more
        for p in (f"{system} then a", f"{system} then b"):
            client.completions.create(model=MODEL, prompt=p, max_tokens=4)
        s.drained()
        st = s.engine.scheduler.check_stats()
        assert st is not None and st["ticks"] > 0
        m = bench_serve.scrape(s.url)  # the production subset is on by default in batch-llm serve
        assert m["batch:invariant_checked_ticks_total"] > 0 and "batch:invariant_violations_total" not in str(m)
        if kw.get("prefix_caching"):
            assert st["reference_skipped"] == st["trace_skipped"] == {"prefix_caching": st["ticks"]}, st
            assert s.engine.scheduler.metrics()["prefix_cache_hits"] > 0  # the shared system prompt hit
        else:
            assert st["reference_checked"] > 0 and st["trace_checked"] > 0, st


@pytest.mark.parametrize("production_checks", [False, True])
def test_a_planted_ledger_bug_in_the_served_scheduler_is_caught(monkeypatch, production_checks):
    """The served scheduler is checked. A tick that leaks a block (planted): with the production
    subset off, the suite's full checks stop the engine with an ``InvariantViolation`` (503); with
    it on (``batch-llm serve``'s default) the plan never reaches the backend, the request fails
    (500, the retry policy) and ``/metrics`` counts the violation, and the server goes on."""
    from batch.core import step

    real = step.commit

    def leaky(state, plan):  # one extra block taken from the pool and held by nobody
        journal = real(state, plan)
        if plan.seqs and state.pool.num_free:
            state.pool.allocate(1)
        return journal
    with LiveServer(time_scale=0.01, production_checks=production_checks) as s:
        forwarded = []
        gpu = s.engine.scheduler._backend
        monkeypatch.setattr(s.engine.scheduler, "_backend", lambda batch: forwarded.append(len(batch)) or gpu(batch))
        monkeypatch.setattr(step, "commit", leaky)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        if production_checks:
            assert r.status_code == 500 and forwarded == [], (r.status_code, forwarded)
            assert _metric(s.url, 'batch:invariant_violations_total{property="ledger_delta"}') == 3  # three tries
            assert s.engine.alive and s.engine.error is None
        else:
            assert r.status_code == 503 and "invariant" in r.json()["error"]["message"]
            assert isinstance(s.engine.error, InvariantViolation)
            s.engine.error = None  # the violation is this test's point: let __exit__'s check pass


# ---------------------------------------------------------------- fairness over HTTP


@pytest.mark.slow
def test_ab_burst_over_http_b_within_1_5x_of_alone_on_the_servers_clock():
    """The goal (docs/server.md): B's TTFT with A present within 1.5x of B alone, on the server's
    own clock (handler submit to first token; B's mean TTFT from ``/metrics``), the median over
    five seeds. The client's ratio (B's median TTFT as the client sees it) carries the HTTP stack's
    cost for a burst of 105 requests, which grows with the machine's load, so it is held only to
    5x: a front end that queued B behind A's burst would give 10x and more.

    Measured over 25 runs of this test (its printed line, ``pytest -s``) on the project's 2-core
    machine (2026-12-02): the server's ratio 0.88-1.34 (median 1.02) at any load seen (load
    average 1.1-6.3); the client's 1.06-1.53 in the 16 runs at load average <= 2.3, 1.09-1.61 in
    7 of the 9 runs at 3.2-6.3, and 3.43 and 3.79 in the other two (load 6.3 and 4.0), which the
    earlier bound on the client's ratio (2x) failed.

    The client is ``batch-llm bench-serve --ab-burst`` in its own process (a client does not share the
    server's interpreter), the server this test's. B's 5 requests alone, then 100 of A and 5 of B
    at once (workloads.ab_burst's lengths); once B's first tokens are in, every stream is dropped,
    which also aborts A's requests under load. The GPU's iteration is stretched (time scale 20:
    100 ms + 20 ms a request) so that the HTTP stack's cost does not dominate the client's ratio.
    """
    with LiveServer(ServerConfig(trust_user_field=True), time_scale=20.0, seed=3) as s:
        out = subprocess.run([sys.executable, "-m", "batch.commands", "bench-serve", "--base-url", s.url,
                              "--ab-burst", "--ab-seeds", "4,5,6,7,8", "--ab-drop-after-b", "--json"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        _assert_idle(s.drained(60))
    print(f"A/B over HTTP, median of 5 seeds: server {res['server_ratio_median']:.2f}, "
          f"client {res['ratio_median']:.2f}")  # pytest -s, repeated: the distribution above
    assert res["server_ratio_median"] <= 1.5, res["ab_burst"]  # the goal, on the server's clock
    assert res["ratio_median"] <= 5.0, res["ab_burst"]  # the client's: the HTTP stack's cost included


def run_sybil(url: str, attacks: str, *args: str, duration_s: float = 8.0) -> list[dict]:
    """``batch-llm bench-serve --sybil ATTACKS`` against ``url`` in its own process; each attack's row."""
    out = subprocess.run([sys.executable, "-m", "batch.commands", "bench-serve", "--base-url", url, "--sybil", attacks,
                          "--sybil-duration-s", str(duration_s), "--json", *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["sybil"]


#: The Sybil test's bound: an attacker's share of the tokens (fair: one half).
SYBIL_MAX_SHARE = 0.55


def _identities(server: LiveServer) -> set[str]:
    """Record every fairness identity the server's scheduler is handed from now on (``Policy.add``)."""
    seen: set[str] = set()
    policy = server.engine.scheduler.policy
    add = policy.add

    def recording_add(seq):
        seen.add(seq.user_id)
        add(seq)

    policy.add = recording_add
    return seen


@pytest.mark.slow
def test_sybil_one_key_gets_at_most_55_percent_and_made_up_keys_get_only_401s():
    # An honest key and an attacker's key, each with 64 concurrent long streams (no early EOS) on the
    # stub's 256-block cache, so the two contend for admission; the honest party streams first
    # (backlogged), the attacker then floods: with its one key, with its key and a random `user` per
    # request (the key decides), and with a made-up key per request (401s, no token).
    cfg = ServerConfig(api_keys={"sk-honest": "honest", "sk-attacker": "attacker"})
    with LiveServer(cfg, eos_probability=0.0, time_scale=1.0) as s:
        seen = _identities(s)
        rows = run_sybil(s.url, "one-key,key-random-user,made-up-keys", "--honest-key", "sk-honest",
                         "--attacker-key", "sk-attacker")
        _assert_idle(s.drained(60))
    print("sybil, single server:", [(r["attack"], r["attacker_share"], r["attacker_statuses"]) for r in rows])
    one, rnd, made_up = rows
    for r in (one, rnd):
        assert r["attacker_tokens"] > 0 and set(r["attacker_statuses"]) == {"200"}, r
        assert r["attacker_share"] <= SYBIL_MAX_SHARE, r
    assert made_up["attacker_tokens"] == 0 and made_up["honest_tokens"] > 0, made_up
    assert set(made_up["attacker_statuses"]) == {"401"} and made_up["attacker_statuses"]["401"] >= 64, made_up
    assert seen == {"honest", "attacker"}, seen  # a random `user` per request named no new identity


@pytest.mark.slow
def test_sybil_control_random_user_names_become_new_identities_where_the_user_field_is_trusted():
    # The control: the same flood where the body's `user` is trusted and not checked (no keys,
    # --trust-user-field, the rule every keyless request followed before): each made-up name is a new
    # fair share, which the keyed test above shows cannot happen with keys. The attacker's share is
    # printed, not asserted: it depends on how long the flood runs and how hard the two contend for
    # the cache (measured here on the new core: 0.49 and 0.50 over 8 s, 0.58 over 15 s; the old core
    # gave 0.64 over 5 s and 0.97 over 15 s).
    with LiveServer(ServerConfig(trust_user_field=True), eos_probability=0.0, time_scale=1.0) as s:
        seen = _identities(s)
        (row,) = run_sybil(s.url, "random-user")
        _assert_idle(s.drained(60))
    print("sybil control, user field trusted:", row["attacker_share"], "identities:", len(seen))
    assert row["attacker_tokens"] > 0 and set(row["attacker_statuses"]) == {"200"}, row
    assert len(seen) >= row["attacker_requests"], (len(seen), row)  # one new identity per attacker request


#: The attacker-first Sybil test (issue 38): the honest key's share of the tokens in every window
#: from ``SHARE_WINDOW_SKIP_S`` after it arrives, at least ``MIN_HONEST_SHARE``. The issue implies
#: 60 s of 15-s windows; a test runs ``ATTACKER_FIRST_DURATION_S`` (two back-to-back 15-s windows
#: from 5 s after the honest key arrives), the weighted one ``WEIGHTED_DURATION_S`` (one window).
MIN_HONEST_SHARE = 0.45
SHARE_WINDOW_S = 15.0
SHARE_WINDOW_SKIP_S = 5.0
ATTACKER_FIRST_DURATION_S = 35.0
WEIGHTED_DURATION_S = 20.0
#: Issue 38: weights 2:1 give 67/33 within 3 points.
WEIGHTED_TOLERANCE = 0.03
SYBIL_KEYS = {"sk-honest": "honest", "sk-attacker": "attacker"}


def run_sybil_attacker_first(url: str, duration_s: float, *args: str) -> dict:
    """``batch-llm bench-serve --sybil one-key --attacker-first`` (2-s lead, 15-s windows from 5 s after
    the honest key arrives) against ``url``; its one row."""
    (row,) = run_sybil(url, "one-key", "--attacker-first", "--attacker-lead-s", "2", "--honest-key", "sk-honest",
                       "--attacker-key", "sk-attacker", "--share-window-s", str(SHARE_WINDOW_S),
                       "--share-window-skip-s", str(SHARE_WINDOW_SKIP_S), *args, duration_s=duration_s)
    return row


@pytest.mark.slow
def test_sybil_attacker_first_the_honest_key_gets_at_least_45_percent_in_every_window():
    # Issue 38's order: the attacker's key opens 64 endless streams first (no early EOS, the stub's
    # 256-block cache, real time), the honest key's 64 two seconds later. A core that lets the first
    # comer keep what it holds gave the honest key 20-23% here; a fair one gives it about half in
    # every window from 5 s after it arrives (covered: two 15-s windows, 35 s after it arrives).
    with LiveServer(ServerConfig(api_keys=dict(SYBIL_KEYS)), eos_probability=0.0, time_scale=1.0) as s:
        row = run_sybil_attacker_first(s.url, ATTACKER_FIRST_DURATION_S)
        _assert_idle(s.drained(60))
    shares = [w["honest_share"] for w in row["windows"]]
    print("sybil attacker-first, single server: whole run", row["honest_share"], "windows", shares)
    assert row["order"] == "attacker-first" and len(shares) == 2, row
    assert set(row["attacker_statuses"]) == set(row["honest_statuses"]) == {"200"}, row
    assert all(x is not None and x >= MIN_HONEST_SHARE for x in shares), row  # the whole run's share, with
    # the first 5 s of the honest key's ramp-up, is printed, not bounded: the issue bounds the windows


@pytest.mark.slow
@pytest.mark.parametrize("honest_weight, attacker_weight", [(2, 1), (1, 2)])
def test_sybil_attacker_first_with_weights_2_to_1_gives_67_33_within_3_points(honest_weight, attacker_weight):
    # The same order with the config's weights: the honest key's share in the window from 5 s
    # after it arrives (one 15-s window) within 3 points of its weighted share, whichever key
    # has weight 2.
    fair = honest_weight / (honest_weight + attacker_weight)
    with LiveServer(ServerConfig(api_keys=dict(SYBIL_KEYS)), eos_probability=0.0, time_scale=1.0,
                    weights={"honest": honest_weight, "attacker": attacker_weight}) as s:
        row = run_sybil_attacker_first(s.url, WEIGHTED_DURATION_S, "--sybil-weights",
                                       f"{honest_weight}:{attacker_weight}")
        _assert_idle(s.drained(60))
    shares = [w["honest_share"] for w in row["windows"]]
    print(f"sybil attacker-first, weights {honest_weight}:{attacker_weight}: whole run", row["honest_share"],
          "windows", shares)
    assert len(shares) == 1 and row["fair_honest_share"] == pytest.approx(fair), row
    assert all(x is not None and abs(x - fair) <= WEIGHTED_TOLERANCE for x in shares), row


def test_window_shares_count_each_partys_tokens_per_window():
    honest = [0.5, 1.0, 1.5, 2.5, 3.5, 9.0]
    attacker = [0.2, 1.2, 2.0, 2.1, 2.9, 3.0]
    w = bench_serve.window_shares(honest, attacker, 1.0, 3.0, window_s=1.0)  # [1, 2) and [2, 3)
    assert [(x["from_s"], x["to_s"], x["honest_tokens"], x["attacker_tokens"]) for x in w] == \
        [(0.0, 1.0, 2, 1), (1.0, 2.0, 1, 3)]
    assert [x["honest_share"] for x in w] == [2 / 3, 1 / 4]
    w = bench_serve.window_shares(honest, attacker, 1.0, 3.5, window_s=1.0, step_s=0.5)  # sliding
    assert [(x["from_s"], x["honest_tokens"], x["attacker_tokens"]) for x in w] == \
        [(0.0, 2, 1), (0.5, 1, 2), (1.0, 1, 3), (1.5, 1, 2)]
    assert bench_serve.window_shares([], [], 0.0, 2.0, window_s=1.0)[0]["honest_share"] is None
    assert bench_serve.window_shares(honest, attacker, 0.0, 0.9, window_s=1.0) == []  # no window fits
    row = {"windows": bench_serve.window_shares(honest, attacker, 1.0, 3.0, window_s=1.0)}
    spread = bench_serve.share_spread(row)
    assert spread["min"] == 1 / 4 and spread["max"] == 2 / 3 and spread["shares"] == [2 / 3, 1 / 4]
    assert spread["mean"] == pytest.approx((2 / 3 + 1 / 4) / 2)
    for bad in ({"window_s": 0.0}, {"window_s": 1.0, "step_s": -1.0}):
        with pytest.raises(ValueError, match="must be > 0"):
            bench_serve.window_shares(honest, attacker, 0.0, 3.0, **bad)


def test_sybil_and_stall_command_lines_refuse_bad_arguments(srv):
    base = ["--base-url", srv.url]
    for argv, what in ((["--sybil", "one-key", "--attacker-lead-s", "2"], "--attacker-lead-s needs --attacker-first"),
                       (["--sybil", "one-key", "--sybil-weights", "2:0"], "--sybil-weights"),
                       (["--sybil", "one-key", "--attacker-first", "--share-window-s", "0"], "--share-window-s"),
                       (["--stall", "0"], "--stall")):
        out = subprocess.run([sys.executable, "-m", "batch.commands", "bench-serve", *base, *argv],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and what in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)


def test_stall_probe_times_the_same_request_idle_and_beside_a_keys_long_streams():
    # The stall probe's mechanics (its figure is a benchmark's: docs, issue 38): 8 streams of 3000
    # tokens on one key for 1 s, then 2 probes of another key, each a 2-token request timed to its
    # first token, as the 2 idle ones before; /health read at each loaded probe.
    with LiveServer(ServerConfig(api_keys=dict(SYBIL_KEYS)), eos_probability=0.0, time_scale=0.05) as s:
        out = subprocess.run([sys.executable, "-m", "batch.commands", "bench-serve", "--base-url", s.url, "--stall",
                              "8", "--stall-warmup-s", "1", "--stall-probes", "2", "--stall-probe-gap-s", "0.1",
                              "--honest-key", "sk-honest", "--attacker-key", "sk-attacker", "--json"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)["stall"]
        _assert_idle(s.drained(60))
    assert len(r["idle_ttft_s"]) == len(r["loaded_ttft_s"]) == len(r["health"]) == 2, r
    assert r["ratio_median"] == pytest.approx(r["loaded_median_s"] / r["idle_median_s"]), r
    assert r["stream_tokens"] > 0 and r["stream_statuses"] == {"200": 8}, r  # no stream ended in 1 s
    assert all(h["running"] + h["waiting"] >= 8 for h in r["health"]), r  # the streams were there at each probe
    # the probes' TTFT on the server's clock too, from /metrics read with the probe's key
    assert r["server_idle_mean_s"] > 0 and r["server_loaded_mean_s"] > 0, r
    assert r["server_ratio"] == pytest.approx(r["server_loaded_mean_s"] / r["server_idle_mean_s"]), r


def test_user_sums_add_a_users_series_over_the_other_labels():
    name = "batch:user_time_to_first_token_seconds_count"
    m = {f'{name}{{user="a",replica="0"}}': 2.0, f'{name}{{replica="1",user="a"}}': 3.0, f'{name}{{user="b"}}': 1.0,
         f'{name}_other{{user="a"}}': 9.0, "batch:other": 4.0}
    assert bench_serve.user_sums(m, name) == {"a": 5.0, "b": 1.0}


# ---------------------------------------------------------------- the command


def test_batch_llm_command_dispatch(capsys):
    assert commands.main([]) == 2
    assert commands.main(["bogus"]) == 2
    assert "unknown command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        commands.main(["serve", "--help"])
    assert e.value.code == 0 and "--time-scale" in capsys.readouterr().out


# ---------------------------------------------------------------- the model backend


@pytest.mark.slow
def test_model_backend_over_http_stream_matches_non_stream(tmp_path):
    # The Hugging Face backend on a local checkpoint folder (tiny seeded Llama + a word-level
    # tokenizer saved beside it, as --model PATH reads them): text in, text out, greedy, so the
    # streamed text equals the non-streamed one.
    pytest.importorskip("torch")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from batch.backends.model_backend import tiny_llama

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(tmp_path)
    tiny_llama(seed=0).save_pretrained(tmp_path)
    with LiveServer(backend="model", model=str(tmp_path)) as s:
        client = s.openai()
        assert [m.id for m in client.models.list()] == [tmp_path.name]
        prompt = "w5 w17 w99 w3"
        full = client.completions.create(model=tmp_path.name, prompt=prompt, max_tokens=12)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=tmp_path.name, prompt=prompt, max_tokens=12, stream=True))
        assert streamed == full.choices[0].text and full.usage.prompt_tokens == 4
        assert all(w.startswith("w") or w in ("[UNK]", "<s>") for w in full.choices[0].text.split())
        _assert_idle(s.drained())
    with LiveServer(backend="model") as s:  # no --model: the tiny seeded Llama on UTF-8 bytes
        client = s.openai()
        a = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8)
        b = "".join(c.choices[0].text for c in client.completions.create(model="tiny-llama", prompt="hello",
                                                                         max_tokens=8, stream=True))
        assert a.choices[0].text == b and a.usage.prompt_tokens == 5


# ---------------------------------------------------------------- review findings


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 3}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 3}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 3}', "messages"),
])
def test_lone_surrogate_is_400_naming_the_field(srv, path, raw, param):
    r = httpx.post(f"{srv.url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unexpected_exception_is_an_openai_shaped_500(srv, monkeypatch):
    def boom(text):
        raise KeyError("tokenizer bug")
    monkeypatch.setattr(srv.app.state.server.tok, "encode", boom)
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == 500 and set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000,
                                 b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"],
                         ids=["body", "extra-field"])
def test_deeply_nested_json_is_400(srv, raw):
    r = httpx.post(f"{srv.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_the_limit_is_413_before_parsing():
    with LiveServer(ServerConfig(max_body_bytes=1000)) as s:
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "w " * 100, "max_tokens": 2})
        assert ok.status_code == 200
        big = json.dumps({"prompt": "w " * 1000, "max_tokens": 2}).encode()
        r = httpx.post(f"{s.url}/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
        chunked = httpx.post(f"{s.url}/v1/chat/completions", content=iter([big[:600], big[600:]]),
                             headers={"content-type": "application/json"})  # no Content-Length: counted
        assert chunked.status_code == 413 and set(chunked.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenizers_stop_past_the_limit():
    words, n = WordTokenizer(), 10
    assert words.encode("a b c") == words.encode("a b c", limit=n)
    assert len(words.encode("w " * 1000, limit=n)) == n + 1
    assert words.encode("w " * 1000, limit=n) == words.encode("w " * (n + 1))
    from batch.server.tokenizer import ByteTokenizer
    assert ByteTokenizer().encode("é" * 100, limit=n) == list(("é" * 100).encode())[:n + 1]


def test_engine_death_answers_requests_queued_during_the_fatal_tick():
    # The fatal tick runs 0.5 s; requests sent meanwhile sit in the engine's command queue when
    # the thread dies. Each must be answered (503, or a stream's error chunk then [DONE]).
    with LiveServer(time_scale=0.2) as s:
        sched = s.engine.scheduler
        orig, armed = sched.update_from_output, threading.Event()

        def boom(*a, **k):
            if armed.is_set():
                time.sleep(0.5)
                raise RuntimeError("scheduler bug")
            return orig(*a, **k)
        sched.update_from_output = boom

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=15) as c:
                assert (await c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3})).status_code == 200
                armed.set()
                first = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "first", "max_tokens": 50}))
                await asyncio.sleep(0.2)  # the fatal tick is running

                async def one(i):
                    body = {"prompt": f"p{i}", "max_tokens": 5, "stream": i % 2 == 1}
                    if not body["stream"]:
                        r = await c.post("/v1/completions", json=body)
                        return r.status_code, r.json()["error"]["type"]
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]"
                    return r.status_code, json.loads(lines[-2][6:])["error"]["type"]
                rest = await asyncio.gather(*(one(i) for i in range(6)))
                return await first, rest
        first, rest = asyncio.run(go())
        assert first.status_code == 503
        for i, (code, kind) in enumerate(rest):
            assert code == (200 if i % 2 else 503) and kind == "service_unavailable", (i, code, kind)
        assert not s.engine.alive
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}).status_code == 503


def test_per_user_metric_labels_are_bounded():
    # the config's users (here a weighted one) count against the cap as any other
    with LiveServer(ServerConfig(max_user_labels=3, trust_user_field=True), weights={"vip": 2}) as s:
        for u in ["vip", *(f"rnd{i}" for i in range(8))]:
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2, "user": u})
            assert r.status_code == 200
        m = bench_serve.scrape(s.url)
    labelled = {k.split('"')[1] for k in m if k.startswith("batch:prompt_tokens_total{")}
    assert labelled == {"vip", "rnd0", "rnd1", "other"}
    assert m['batch:prompt_tokens_total{user="other"}'] == 6 * 2
    gen = {k.split('"')[1] for k in m if k.startswith("batch:generation_tokens_total{")}
    ttft = {k.split('"')[1] for k in m if k.startswith("batch:user_time_to_first_token_seconds_count{")}
    assert gen == ttft == labelled


def test_the_servers_own_per_user_state_stays_bounded_over_many_users():
    # outside the scheduler, the server keeps per user only its metric labels: the first
    # max_user_labels users; 20,000 more users add no label and no series
    from batch.server.metrics import ServerMetrics
    m = ServerMetrics(build_engine(time_scale=0.01)[0], max_user_labels=10)
    for i in range(20_000):
        label = m.user_label(f"u{i}")
        m.prompt_tokens.labels(label).inc(3)
        m.generation_tokens.labels(label).inc(1)
        m.user_ttft.labels(label).observe(0.01)
    assert len(m._labels) == 10
    series = {k for k in m.render().decode().splitlines() if k.startswith("batch:prompt_tokens_total{")}
    assert len(series) == 11  # u0..u9 and "other"


@pytest.mark.parametrize("sig, times", [("SIGTERM", 1), ("SIGINT", 1), ("SIGINT", 2)])
def test_shutdown_under_load_ends_every_stream_and_exits(sig, times):
    # `batch-llm serve` in its own process, 8 endless streams open (no EOS, 3000 tokens each); a
    # signal (or two): every stream ends with a last chunk finish_reason "abort" and [DONE], the
    # server exits within its --shutdown-timeout (plus slack), says so once, no traceback.
    import signal
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "batch.commands", "serve", "--port", str(port),
                             "--eos-probability", "0", "--time-scale", "0.5", "--shutdown-timeout", "5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)

        async def go():
            started = asyncio.Event()
            n_started = [0]

            async def one(c, i):
                body = {"prompt": f"s{i} t", "max_tokens": 3000, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = []
                    async for ln in r.aiter_lines():
                        if ln.startswith("data: "):
                            lines.append(ln)
                            if len(lines) == 2:
                                n_started[0] += 1
                                if n_started[0] == 8:
                                    started.set()
                    return lines

            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                tasks = [asyncio.ensure_future(one(c, i)) for i in range(8)]
                await asyncio.wait_for(started.wait(), 30)
                t0 = time.monotonic()
                for _ in range(times):
                    proc.send_signal(getattr(signal, sig))
                    await asyncio.sleep(0.01)
                return await asyncio.gather(*tasks), t0
        streams, t0 = asyncio.run(go())
        proc.wait(timeout=5 + 10)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate()
    for lines in streams:
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert elapsed < 5 + 10 and "Traceback" not in err, err
    assert err.count("shutting down") == 1, err


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"n": 0}, "n"), ({"best_of": 3}, "best_of"), ({"echo": True}, "echo"),
    ({"logprobs": 5}, "logprobs"), ({"logprobs": 0}, "logprobs"), ({"suffix": "x"}, "suffix"),
    ({"stop": "\n"}, "stop"), ({"stop": ["a", "b"]}, "stop"),
])
def test_unsupported_options_are_400_naming_the_field(srv, extra, param):
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    if param == "logprobs":
        chat["logprobs"] = True
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_unsupported_options_are_accepted(srv):
    body = {"prompt": "x", "max_tokens": 2, "n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": "",
            "stop": [], "temperature": 0.7}
    assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 200
    sampling = {"temperature": 0, "top_p": 1, "presence_penalty": -2, "frequency_penalty": 0.5, "seed": 3,
                "logit_bias": {"5": -100}, "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.1,
                "stream_options": None}
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **sampling}).status_code == 200
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True,
                                                               "stream_options": {"include_usage": False}}) as r:
        assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 1, "logprobs": False, "stop": None}
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=chat).status_code == 200


def test_every_error_answer_is_counted_by_status():
    with LiveServer(ServerConfig(max_body_bytes=2000)) as s:
        bad = [("/v1/completions", {"prompt": "x", "n": 2}), ("/v1/completions", {"prompt": "\ud800"}),
               ("/v1/completions", {"prompt": "x", "max_tokens": "5"}), ("/v1/completions", {"prompt": "w " * 5000}),
               ("/v1/chat/completions", {"messages": []}), ("/v1/completions", {"prompt": "x", "model": "gpt-9"}),
               ("/nowhere", {})]
        codes = [httpx.post(f"{s.url}{p}", content=json.dumps(b), headers={"content-type": "application/json"})
                 .status_code for p, b in bad]
        assert codes == [400, 400, 400, 413, 400, 404, 404]
        m = bench_serve.scrape(s.url)
    assert m.get('batch:request_rejected_total{code="400"}') == 4
    assert m.get('batch:request_rejected_total{code="413"}') == 1
    assert m.get('batch:request_rejected_total{code="404"}') == 2


def test_response_ids_are_random_and_created_is_the_response_time(srv):
    import re
    t0 = int(time.time())
    a = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
    b = httpx.post(f"{srv.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).json()
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", a["id"]) and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", b["id"])
    assert a["id"] != chunks[0]["id"]
    t1 = int(time.time())
    assert t0 <= a["created"] <= t1 and t0 <= b["created"] <= t1
    assert {c["created"] for c in chunks} <= set(range(t0, t1 + 1)) and len({c["created"] for c in chunks}) == 1


def test_max_tokens_reached_is_finish_reason_length():
    with LiveServer(eos_probability=0.0) as s:
        r = s.openai().completions.create(model=MODEL, prompt="a b c", max_tokens=5)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        assert len(r.choices[0].text.split()) == 5  # no EOS among them: five words
        chunks = list(s.openai().chat.completions.create(model=MODEL, max_tokens=4, stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]))
        assert chunks[-1].choices[0].finish_reason == "length"


def test_bench_serve_counts_a_failed_stream_as_an_error():
    engine = Engine(Scheduler(backend=_FailingGPU(time_scale=0.05), max_backend_tries=3, record_itl=False))
    with LiveServer(engine=engine) as s:
        results = [asyncio.run(bench_serve.run_jobs(s.url, [bench_serve.Job(user="u", prompt_words=3,
                                                                           max_tokens=5, tag=tag)]))[0][0]
                   for tag in ("BAD", "fine")]  # one at a time: a failing batch fails all its requests
    assert [r.outcome for r in results] == ["error", "ok"], [(r.outcome, r.detail) for r in results]
    assert results[0].finish_reason == "error"
