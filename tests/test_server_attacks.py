"""``batch-llm serve`` facing the internet (issue 39): what an attacker can send, answered without a
500, without holding the server, and within bounded memory.

Connections (``batch.server.limits``): a socket that never sends a byte or sends its request
head slowly is closed after ``--timeout-headers``; idle sockets past the open-files limit or the
connection cap leave ``/health`` and a keyed request answering (the soft open-files limit is raised
to the hard one; at the cap the connection idle longest is closed); a new connection when every
connection is busy gets a 503 in OpenAI's shape, counted; a head over the size or header-count
cap gets a 431; a NUL byte in a key gets a 400 in OpenAI's shape. Bodies: no body in the list
gets a 500 (huge integers in any field, deep nesting, invalid UTF-8, NUL bytes, NaN, ...), each is
a 4xx in OpenAI's shape and the keep-alive connection stays usable; a body that is not
``application/json`` is a 415; a token id past 2**31 - 1 is refused without a vocabulary. Keys: the
lookup is a dict on the key's digest, holding no key; per-user series stay bounded however many
users the config names; ``/metrics`` needs a key by default with keys; the API docs routes are off
with keys. The Ray front door (``--replicas``) shares the body and key paths.

Behaviour only: speed and memory figures come from ``batch-llm bench-serve --attack`` and
``bench/server_keys.py`` (docs/server.md, "Connections and hostile input").
"""
from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batch.server import bench_serve  # noqa: E402
from batch.server.app import ServerConfig, create_app  # noqa: E402
from batch.server.auth import Identities, KeyRing  # noqa: E402
from batch.server.serve import build_engine  # noqa: E402
from spec.invariants import InvariantViolation  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"sk-alice-1": "alice", "sk-bob-1": "bob"}
ALICE = {"Authorization": "Bearer sk-alice-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GuardedServer:
    """``create_app`` served as ``batch-llm serve`` serves it (``app.state.guard.uvicorn_config``: the
    connection limits on), uvicorn in a daemon thread on a free port."""

    def __init__(self, cfg: ServerConfig | None = None, base: type | None = None, **engine_kw) -> None:
        engine_kw.setdefault("time_scale", 0.05)
        engine, tok, name = build_engine(**engine_kw)
        cfg = cfg or ServerConfig()
        cfg.model_name = name
        self.engine = engine
        self.app = create_app(engine, tok, cfg)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.app.state.guard.uvicorn_config(self.app, base, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "GuardedServer":
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

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        return bench_serve.scrape(self.url, headers=headers)


class ServeProcess:
    """``batch-llm serve ARGS`` in its own process (its soft open-files limit set to ``nofile``)."""

    def __init__(self, *args: str, nofile: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "batch.commands", "serve", "--port", str(self.port),
                                      "--time-scale", "0.05", *args], cwd=ROOT, env=env, preexec_fn=limit,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> "ServeProcess":
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise AssertionError(f"batch-llm serve did not start: {self.proc.stderr.read()}") from None
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr = self.proc.stderr.read()


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _raw_answer(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[int, dict, bytes]:
    """Send ``data`` on a fresh socket; the answer's status, headers and body (read to close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        buf = b""
        while True:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            buf += part
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (read without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes | None = None) -> float | None:
    """Seconds until the server closes ``sock`` (sending ``trickle`` a byte at a time every 0.2 s
    meanwhile, if given), or ``None`` if it is still open after ``seconds``."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    i = 0
    while time.monotonic() - t0 < seconds:
        if trickle is not None:
            try:
                sock.send(trickle[i % len(trickle):i % len(trickle) + 1])
            except OSError:
                return time.monotonic() - t0
            i += 1
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


# ---------------------------------------------------------------- connections


def test_a_socket_that_never_sends_a_byte_or_sends_its_head_slowly_is_closed_after_the_head_timeout():
    from batch.server.limits import HttpLimits
    with GuardedServer(ServerConfig(limits=HttpLimits(timeout_headers=1.0))) as s:
        silent = socket.create_connection(("127.0.0.1", s.port))
        slow = socket.create_connection(("127.0.0.1", s.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        waits = {}
        t = threading.Thread(target=lambda: waits.update(silent=_closed_within(silent, 8.0)))
        t.start()
        waits["slow"] = _closed_within(slow, 8.0, trickle=b"X-Slow: 1\r\n")  # never a blank line
        t.join()
        silent.close()
        slow.close()
        m = s.metrics()
    assert waits["silent"] is not None and waits["slow"] is not None, waits  # both closed, not held
    assert m["batch:http_header_timeouts_total"] == 2


def test_a_keep_alive_connection_serves_requests_and_a_long_stream_outlives_the_head_timeout():
    from batch.server.limits import HttpLimits
    with GuardedServer(ServerConfig(limits=HttpLimits(timeout_headers=0.5)), time_scale=1.0,
                       eos_probability=0.0) as s:
        with httpx.Client(base_url=s.url) as c:
            for _ in range(30):  # the head counts are reset per request: no false 431 on a long keep-alive
                assert c.get("/health").status_code == 200
            with c.stream("POST", "/v1/completions", json={"prompt": "a b", "max_tokens": 150, "stream": True}) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        m = s.metrics()
    assert lines[-1] == "data: [DONE]" and len(lines) == 151  # 150 token chunks over ~1 s (5 ms+ a tick)
    assert m["batch:http_header_timeouts_total"] == 0


def test_idle_and_slow_sockets_past_the_open_files_limit_leave_health_and_a_keyed_request_answering(tmp_path):
    # the server's soft open-files limit is 1,024 (as on most systems; 'batch-llm serve' raises it to
    # the hard limit); 1,100 sockets that never finish a head, then /health and a keyed request
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    server_soft = 1024 if hard >= 2400 else max(64, hard // 4)
    n_idle = server_soft + 76
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the sockets
    cfg = tmp_path / "keys.toml"
    cfg.write_text('[api_keys]\n"sk-alice-1" = "alice"\n')
    socks = []
    with ServeProcess("--config", str(cfg), nofile=server_soft) as s:
        try:
            for i in range(n_idle):
                sk = socket.create_connection(("127.0.0.1", s.port))
                if i % 2:
                    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head never finished
                socks.append(sk)
            time.sleep(0.5)
            health = httpx.get(f"{s.url}/health", timeout=10)
            ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2}, headers=ALICE,
                            timeout=10)
            m = bench_serve.scrape(s.url, headers=ALICE)
        finally:
            for sk in socks:
                sk.close()
    assert health.status_code == 200 and ok.status_code == 200, ok.text
    assert m["batch:http_connections"] >= n_idle  # all held at once: the limit was raised
    assert m["batch:http_connections_refused_total"] == 0


def test_at_the_connection_cap_the_longest_idle_connection_makes_room_and_a_busy_server_answers_503():
    from batch.server.limits import HttpLimits
    with GuardedServer(ServerConfig(limits=HttpLimits(limit_concurrency=40)), time_scale=1.0,
                       eos_probability=0.0) as s:
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(60)]  # 20 past the cap
        time.sleep(0.3)
        r = httpx.get(f"{s.url}/health", timeout=10)  # evicts the idle one waiting longest
        assert r.status_code == 200
        time.sleep(0.2)
        evicted = sum(1 for sk in idle if _is_closed(sk))
        for sk in idle:
            sk.close()
        # now 40 busy connections (endless streams): the 41st is refused with a 503 in OpenAI's shape
        streams = []
        with httpx.Client(base_url=s.url, timeout=30, limits=httpx.Limits(max_connections=50)) as c:
            for _ in range(40):  # each stream holds its own connection
                resp = c.send(c.build_request("POST", "/v1/completions",
                                              json={"prompt": "a", "max_tokens": 100_000, "stream": True}),
                              stream=True)
                assert resp.status_code == 200
                streams.append(resp)
            refused = httpx.get(f"{s.url}/health", timeout=10)
            for resp in streams:
                resp.close()
        time.sleep(0.5)
        m = s.metrics()
    assert evicted >= 20 and m["batch:http_connections_evicted_total"] >= 21
    err = _openai_error(refused, 503)
    assert err["type"] == "service_unavailable" and refused.headers["connection"] == "close"
    assert m["batch:http_connections_refused_total"] == 1 and m['batch:request_rejected_total{code="503"}'] == 1


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",  # one header over 16 KiB
    b"GET /health?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line over 16 KiB
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
], ids=["header-size", "request-line", "header-count"])
def test_a_request_head_over_the_caps_gets_431_in_openai_shape(head):
    with GuardedServer() as s:
        status, headers, body = _raw_answer(s.port, head)
        assert httpx.get(f"{s.url}/health").status_code == 200  # the server goes on
        m = s.metrics()
    assert status == 431 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert m['batch:request_rejected_total{code="431"}'] == 1


def test_a_nul_byte_in_a_key_gets_an_error_in_openai_shape():
    with GuardedServer(ServerConfig(api_keys=KEYS)) as s:
        status, headers, body = _raw_answer(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                    b"Authorization: Bearer sk-alice\x00-1\r\ncontent-type: "
                                                    b"application/json\r\ncontent-length: 2\r\n\r\n{}")
        m = s.metrics(ALICE)
    assert status in (400, 401) and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and "sk-" not in err["message"]
    assert m[f'batch:request_rejected_total{{code="{status}"}}'] == 1


def test_the_guard_holds_on_uvicorns_h11_parser_too():
    # uvicorn falls back to h11 without httptools: the same timeout, caps and JSON 400
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from batch.server.limits import HttpLimits
    with GuardedServer(ServerConfig(limits=HttpLimits(timeout_headers=1.0)), base=H11Protocol) as s:
        with httpx.Client(base_url=s.url) as c:
            for _ in range(30):
                assert c.get("/health").status_code == 200
        slow = socket.create_connection(("127.0.0.1", s.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closed = _closed_within(slow, 8.0, trickle=b"X-Slow: 1\r\n")
        slow.close()
        big = _raw_answer(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        nul = _raw_answer(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\x00b\r\n\r\n")
        m = s.metrics()
    assert closed is not None and m["batch:http_header_timeouts_total"] == 1
    assert big[0] == 431 and nul[0] == 400 and nul[1]["content-type"] == "application/json"


def test_batch_serve_refuses_bad_connection_limits_naming_them(capsys):
    from batch.server import serve
    for args, named in ((["--timeout-headers", "0"], "--timeout-headers"),
                        (["--timeout-keep-alive", "-1"], "--timeout-keep-alive"),
                        (["--limit-concurrency", "0"], "limit_concurrency"),
                        (["--h11-max-incomplete-event-size", "0"], "h11_max_incomplete_event_size"),
                        (["--h11-max-header-count", "0"], "h11_max_header_count")):
        with pytest.raises(SystemExit) as e:
            serve.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and named in err and "unrecognized" not in err, (args, err)


# ---------------------------------------------------------------- bodies


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BIG = "9" * 5000  # past Python's 4,300-digit int-str conversion limit
LARGE = "9" * 4000  # parses, and is still no sensible count
BAD_BODIES = {
    "huge-int-max-tokens": f'{{"prompt": "a", "max_tokens": {BIG}}}'.encode(),
    "huge-int-unknown-field": f'{{"prompt": "a", "whatever": {BIG}}}'.encode(),
    "huge-int-in-prompt-ids": f'{{"prompt": [1, {BIG}]}}'.encode(),
    "huge-negative-int": f'{{"prompt": "a", "seed": -{BIG}}}'.encode(),
    "huge-int-top-level": BIG.encode(),
    "large-int-max-tokens": f'{{"prompt": "a", "max_tokens": {LARGE}, "n": {LARGE}}}'.encode(),
    "large-int-fields": f'{{"prompt": "a", "max_tokens": 2, "seed": {LARGE}, "top_k": {LARGE}, '
                        f'"logit_bias": {{"1": {LARGE}}}, "best_of": {LARGE}, "logprobs": {LARGE}}}'.encode(),
    "token-id-1e20": b'{"prompt": [100000000000000000000]}',
    "token-id-large": f'{{"prompt": [[{LARGE}]]}}'.encode(),
    "deep-nesting": f'{{"prompt": "a", "x": {_nested(100_000)}}}'.encode(),
    "deep-nesting-parseable": f'{{"prompt": "a", "x": {_nested(900)}}}'.encode(),
    "deep-text-part": ('{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                       + _nested(900) + '}]}]}').encode(),
    "invalid-utf8": b'{"prompt": "\xff\xfe\xc3\x28"}',
    "nul-byte-raw": b'{"prompt": "a\x00b"}',
    "nul-byte-outside": b'{"prompt": "a"}\x00',
    "nan": b'{"prompt": "a", "temperature": NaN}',
    "infinity": b'{"prompt": "a", "top_p": -Infinity}',
    "float-overflow": b'{"prompt": "a", "repetition_penalty": 1e999}',
    "lone-surrogate": b'{"prompt": "\\ud800"}',
    "empty": b"",
    "not-an-object": b'["prompt"]',
    "null": b"null",
    "truncated": b'{"prompt": "a", "max_tokens": 1',
    "utf16-bom": '{"prompt": "a"}'.encode("utf-16"),
}
CHAT_BODIES = {"deep-text-part"}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_no_body_gets_a_500_each_is_a_4xx_in_openai_shape_and_the_connection_stays_usable(name):
    # a 200 only where the value is in a field the server ignores (an unknown field, however deep)
    path = "/v1/chat/completions" if name in CHAT_BODIES else "/v1/completions"
    with GuardedServer() as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", path, body=BAD_BODIES[name], headers={"content-type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        sock = conn.sock
        conn.request("POST", "/v1/completions", body=b'{"prompt": "a b", "max_tokens": 2}',
                     headers={"content-type": "application/json"})
        after = conn.getresponse()
        after.read()
        same = conn.sock is sock and sock is not None
        conn.close()
        m = s.metrics()
    assert r.status == 200 or (400 <= r.status < 500 and r.status != 499), (r.status, body[:300])
    assert r.getheader("content-type") == "application/json"
    if r.status != 200:  # an unknown field's value is ignored, however deep
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert after.status == 200 and same  # the keep-alive connection was left usable
    assert not any("code=\"500\"" in k for k in m)


FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "user", "model",
          "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "logit_bias", "top_k", "min_p",
          "repetition_penalty", "n", "best_of", "echo", "logprobs", "suffix", "stop", "role", "content", "text",
          "type", "include_usage"]


@pytest.fixture(scope="module")
def fuzz_client():
    from starlette.testclient import TestClient
    engine, tok, name = build_engine(time_scale=0.01, kv_cap_blocks=8)  # 128-token cache: any request ends fast
    with TestClient(create_app(engine, tok, ServerConfig(model_name=name)), raise_server_exceptions=False) as c:
        yield c


def _fuzz_strategies():
    from hypothesis import strategies as st
    scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
               | st.text(max_size=20) | st.sampled_from(["user", "text", "system", "batch-sim", ""]))
    values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                          | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), kids, max_size=4),
                          max_leaves=20)
    bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
    return st, bodies


def _check_no_500(r) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_random_json_bodies_never_get_a_500(fuzz_client):
    from hypothesis import given, settings
    st, bodies = _fuzz_strategies()

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(bodies, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(body, path):
        raw = json.dumps(body, allow_nan=True).encode()
        _check_no_500(fuzz_client.post(path, content=raw, headers={"content-type": "application/json"}))

    check()


def test_random_bytes_and_mutated_bodies_never_get_a_500(fuzz_client):
    from hypothesis import given, settings
    from hypothesis import strategies as st
    valid = b'{"prompt": "a b", "max_tokens": 3, "stream": true, "messages": [{"role": "user", "content": "x"}]}'

    junk = st.binary(max_size=8) | st.sampled_from([b"9" * 5000, b"-" + b"9" * 4400, b"[" * 100_000, b"[" * 900,
                                                     b'"\\ud800"', b"\xff\xfe", b"\x00", b"NaN", b"1e999", b"{}"])

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.binary(max_size=200) | st.builds(lambda at, junk, cut: valid[:at] + junk + valid[at + cut:],
                                               st.integers(0, len(valid)), junk, st.integers(0, 4)),
           st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(raw, path):
        _check_no_500(fuzz_client.post(path, content=raw, headers={"content-type": "application/json"}))

    check()


def test_a_token_id_past_int32_is_refused_when_the_backend_has_no_vocabulary():
    with GuardedServer() as s:
        for ids in ([10**20], [2**31], [-1]):
            err = _openai_error(httpx.post(f"{s.url}/v1/completions", json={"prompt": ids, "max_tokens": 1}), 400)
            assert err["param"] == "prompt" and "2147483647" in err["message"]
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": [2**31 - 1, 5], "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), (None, 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415),
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
])
def test_only_json_bodies_are_read_else_415(content_type, status):
    with GuardedServer(ServerConfig(api_keys=KEYS)) as s:
        headers = dict(ALICE)
        if content_type is not None:
            headers["content-type"] = content_type
        body = b'{"prompt": "a b", "max_tokens": 2}'
        r = httpx.post(f"{s.url}/v1/completions", content=body, headers=headers)
        chat = httpx.post(f"{s.url}/v1/chat/completions", headers=headers,
                          content=b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}')
        no_key = httpx.post(f"{s.url}/v1/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == status and chat.status_code == status
    if status == 415:
        assert _openai_error(r, 415)["type"] == "invalid_request_error"
    assert no_key.status_code == 401  # the key is checked first


# ---------------------------------------------------------------- many keys


class _CountingDigests(bytearray):
    """The ring's digest table, counting the slots read (one slice a slot compared)."""

    reads = 0

    def __getitem__(self, i):
        _CountingDigests.reads += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("n", [1_000, 100_000])
def test_the_key_check_compares_a_constant_number_of_digests_whatever_the_number_of_keys(n):
    import pickle
    import tracemalloc
    keys = {f"sk-{i:06d}-secret": f"u{i % 1000}" for i in range(n)}
    tracemalloc.start()
    ring = KeyRing(keys)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ring._digests = _CountingDigests(ring._digests)
    _CountingDigests.reads = 0
    sample = list(keys.items())[:2000]
    for k, u in sample:
        assert ring.user_of(k) == u
    hits = _CountingDigests.reads / len(sample)
    _CountingDigests.reads = 0
    for k, _ in sample:
        assert ring.user_of(k + "x") is None
    misses = _CountingDigests.reads / len(sample)
    # a hash table at most half full: about 1.5 slots compared on a hit, 2.5 on a miss, at any size
    # (the scan it replaces compared every configured key's digest: n a request)
    assert hits < 3 and misses < 4, (hits, misses)
    assert held / n < 300  # bytes a key (digests, user numbers, names stored once)
    assert ring.user_of(None) is None and ring.user_of("sk-000005-secret\x00") is None
    assert b"secret" not in pickle.dumps(ring)  # what reaches the replicas: digests only
    assert ring.users() == {f"u{i}" for i in range(min(n, 1000))} and len(ring) == n
    assert Identities(ring).check_key({"authorization": "Bearer sk-000999-secret"}) == "u999"


def test_configured_users_count_against_the_label_cap_and_the_rest_are_other():
    keys = {f"sk-{i}": f"user{i}" for i in range(1000)}
    with GuardedServer(ServerConfig(api_keys=keys, max_user_labels=3)) as s:
        for i in range(6):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2},
                           headers={"Authorization": f"Bearer sk-{i}"})
            assert r.status_code == 200
        m = s.metrics({"Authorization": "Bearer sk-0"})
    labelled = {k.split('"')[1] for k in m if k.startswith("batch:prompt_tokens_total{")}
    assert labelled == {"user0", "user1", "user2", "other"}
    assert m['batch:prompt_tokens_total{user="other"}'] == 3 * 2


def test_activity_of_20000_configured_users_leaves_bounded_series_and_state():
    # every configured user active once, straight through the app's metrics calls: the series and
    # the labels kept stay at the cap, whatever the config holds
    keys = {f"sk-{i}": f"user{i}" for i in range(20_000)}
    engine, tok, _ = build_engine(time_scale=0.01)
    app = create_app(engine, tok, ServerConfig(api_keys=keys, max_user_labels=10))
    m = app.state.server.metrics
    for u in keys.values():
        label = m.user_label(u)
        m.prompt_tokens.labels(label).inc(3)
        m.user_ttft.labels(label).observe(0.01)
    series = [ln for ln in m.render().decode().splitlines() if ln.startswith("batch:prompt_tokens_total{")]
    assert len(series) == 11 and len(m._labels) == 10


def test_metrics_need_a_key_by_default_when_keys_are_configured_and_a_flag_opens_them():
    with GuardedServer(ServerConfig(api_keys=KEYS)) as s:
        closed = httpx.get(f"{s.url}/metrics")
        wrong = httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer sk-nobody"})
        ok = httpx.get(f"{s.url}/metrics", headers=ALICE)
        health = httpx.get(f"{s.url}/health")
    assert _openai_error(closed, 401)["code"] == "invalid_api_key" and wrong.status_code == 401
    assert ok.status_code == 200 and "batch:num_requests_running" in ok.text and health.status_code == 200
    with GuardedServer(ServerConfig(api_keys=KEYS, metrics_need_key=False)) as s:
        assert httpx.get(f"{s.url}/metrics").status_code == 200
    with GuardedServer() as s:  # no keys: open, as /health
        assert httpx.get(f"{s.url}/metrics").status_code == 200


def test_a_client_trying_made_up_keys_gets_at_most_one_answer_per_delay_on_its_connection():
    with GuardedServer(ServerConfig(api_keys=KEYS, auth_failure_delay_s=0.2)) as s:
        answers = 0
        with httpx.Client(base_url=s.url) as c:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                r = c.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": f"Bearer sk-{answers}"})
                assert r.status_code == 401
                answers += 1
            ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2}, headers=ALICE)
    assert answers <= 1.0 / 0.2 + 1 and ok.status_code == 200  # a valid key is not delayed


def test_metrics_renders_are_spaced_shared_and_never_older_than_the_scrape():
    import asyncio

    from batch.server.app import SpacedRenders
    state = {"events": 0, "renders": 0}

    def render():
        state["renders"] += 1
        return state["events"]  # what the render saw

    async def scraper(r: SpacedRenders, end: float, stale: list) -> int:
        n = 0
        while time.monotonic() < end:
            state["events"] += 1
            mine = state["events"]
            if await r.get() < mine:  # a render begun before this call would not see its event
                stale.append(mine)
            n += 1
        return n

    async def main():
        r, stale = SpacedRenders(render, 0.1), []
        end = time.monotonic() + 1.0
        served = await asyncio.gather(*(scraper(r, end, stale) for _ in range(8)))
        return sum(served), stale

    served, stale = asyncio.run(main())
    assert not stale
    assert state["renders"] <= 1.0 / 0.1 + 2 and served >= 8 * state["renders"] // 2  # shared by the 8


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_docs_routes_are_off_with_keys(path):
    with GuardedServer(ServerConfig(api_keys=KEYS)) as s:
        with_keys = httpx.get(f"{s.url}{path}", headers=ALICE)
    with GuardedServer(ServerConfig(disable_fastapi_docs=True)) as s:
        disabled = httpx.get(f"{s.url}{path}")
    with GuardedServer() as s:
        open_ = httpx.get(f"{s.url}{path}")
    assert with_keys.status_code == 404 and disabled.status_code == 404 and open_.status_code == 200


# ---------------------------------------------------------------- the Ray front door (--replicas)


def _ingress_request(raw: bytes, content_type: str | None = "application/json", headers: dict | None = None):
    from starlette.requests import Request
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}
    hs = [(b"content-length", str(len(raw)).encode())]
    if content_type is not None:
        hs.append((b"content-type", content_type.encode()))
    hs += [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "root_path": "",
             "headers": hs}
    return Request(scope, receive)


def test_the_ray_front_door_answers_hostile_bodies_and_keys_as_the_single_server():
    pytest.importorskip("ray", reason="needs the 'scaleout' extra (ray[serve])")
    import asyncio

    from batch.scaleout.ray_serve import Ingress
    ingress = Ingress.func_or_class(object(), identities=Identities(KEYS))

    async def main():
        out = {}
        for name in ("huge-int-max-tokens", "huge-int-unknown-field", "deep-nesting", "invalid-utf8", "nan"):
            out[name] = await ingress(_ingress_request(BAD_BODIES[name], headers=ALICE))
        out["text/plain"] = await ingress(_ingress_request(b'{"prompt": "a"}', "text/plain", ALICE))
        out["no-key"] = await ingress(_ingress_request(b'{"prompt": "a"}'))
        from starlette.requests import Request
        metrics = Request({"type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
                           "root_path": "", "headers": []})
        out["metrics"] = await ingress(metrics)
        return out

    out = asyncio.run(main())
    for name, resp in out.items():
        want = {"text/plain": 415, "no-key": 401, "metrics": 401}.get(name, 400)
        assert resp.status_code == want, (name, resp.status_code, resp.body[:200])
        assert set(json.loads(resp.body)["error"]) == {"message", "type", "param", "code"}
