"""Issue 30, part 6: prefix caching under the model backend and the server.

* The Hugging Face backend reads shared cached blocks: with ``Scheduler(prefix_caching=True)``,
  requests on one shared prefix, batched, equal each request run alone through plain
  transformers, tokens and float64 logits (``tests/test_model_backend.py``'s reference), with
  freed blocks poisoned (NaN) unless the prefix cache keeps them.
* The server's tokenizers give a shared text prefix (a system prompt) the same leading ids, so
  a repeated system prompt hits, and ``/metrics`` counts ``batch:prefix_cache_queries_total`` /
  ``batch:prefix_cache_hits_total`` (vLLM's names, our prefix).
"""
from __future__ import annotations

import pytest

from batch.core.prefix_cache import block_keys
from batch.server.tokenizer import ByteTokenizer, WordTokenizer, plain_chat_prompt
from conftest import StepClock

SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i} applies always." for i in range(70))


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# ---------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("tok", [WordTokenizer(), ByteTokenizer()], ids=["words", "bytes"])
def test_a_shared_system_prompt_tokenizes_to_the_same_leading_ids_and_blocks(tok):
    a = tok.encode(tok.chat_prompt(chat("what is the first rule?")))
    b = tok.encode(tok.chat_prompt(chat("and the last one, please?")))
    head = tok.encode(plain_chat_prompt(chat("x"))[:len(f"system: {SYSTEM}\n")])  # the system line alone
    assert len(head) > 64 and a[:len(head)] == b[:len(head)] == head
    full = len(head) // 16  # every full block of the shared part has the same key in both prompts
    assert block_keys(a, 16)[:full] == block_keys(b, 16)[:full]
    assert a != b


# ---------------------------------------------------------------- the model backend

torch = pytest.importorskip("torch", reason="needs the 'model' extra: pip install -e '.[dev,model]'")
pytest.importorskip("transformers", reason="needs the 'model' extra: pip install -e '.[dev,model]'")

import test_model_backend as tmb  # noqa: E402
from batch.backends.model_backend import ModelBackend  # noqa: E402
from inference_stub import Request  # noqa: E402
from scheduler import Scheduler  # noqa: E402


def shared_prefix_workload():
    """Seven requests on one 70-token prefix (4 full blocks), own suffixes of 9..40 tokens, outputs
    6..20: two together at tick 0, one during their decode, others after they finished (their
    blocks cached, nobody holding them), one on the prefix alone."""
    prefix = tmb.prompt_of(100, 70)
    plan = [(0, 20, 12), (0, 9, 6), (6, 33, 10), (30, 17, 20), (30, 40, 8), (60, 12, 15), (61, 0, 7)]
    return [(t, Request(user_id=f"u{i % 3}", prompt=prefix + tmb.prompt_of(200 + i, n), max_tokens=m,
                        request_id=f"p{i}")) for i, (t, n, m) in enumerate(plan)]


@pytest.mark.parametrize("num_blocks, budget_tokens", [(64, None), (14, 45)])
def test_batched_with_a_shared_prefix_equals_each_request_alone(tmb_ref, num_blocks, budget_tokens):
    backend = ModelBackend(tmb.model(), num_blocks=num_blocks, poison_freed_blocks=True, record_logits=True)
    rec = tmb.Recorder(backend)
    sched = backend.attach(Scheduler(**backend.scheduler_kwargs() | {"backend": rec}, prefix_caching=True,
                                     token_budget_tokens=budget_tokens, clock=StepClock()))
    workload = shared_prefix_workload()
    pending, tick = list(workload), 0
    while pending or sched.has_active():
        while pending and pending[0][0] <= tick:
            sched.submit(pending.pop(0)[1])
        if sched.has_active():
            sched.tick()
            sched.check_integrity()
        tick += 1
        assert tick < 5000
    reqs = [r for _, r in workload]
    tmb.assert_batched_equals_alone(tmb_ref, reqs, backend)
    m = sched.metrics()
    assert m["prefix_cache_hits"] >= 4 * 16 * 4  # at least four admissions found the 4 prefix blocks
    first_seen = {}
    for items in rec.calls:
        for it in items:
            first_seen.setdefault(it.request.request_id, it.num_computed_tokens)
    assert sum(c > 0 for c in first_seen.values()) >= 4  # their first iteration started past the cached prefix
    assert m["kv_blocks_in_use"] == 0


@pytest.fixture(scope="module")
def tmb_ref():
    return tmb.model()


# ---------------------------------------------------------------- the server

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batch.server.app import ServerConfig  # noqa: E402
from test_server import LiveServer, _metric  # noqa: E402

QUERIES, HITS = "batch:prefix_cache_queries_total", "batch:prefix_cache_hits_total"


def test_a_repeated_system_prompt_hits_and_metrics_export_the_hit_rate():
    with LiveServer(ServerConfig(trust_user_field=True), seed=3, prefix_caching=True) as s:
        client = s.openai()
        usage = []
        for q in ("what is the first rule?", "and the last one, please?", "how many rules are there?"):
            r = client.chat.completions.create(model="batch-sim", messages=chat(q), max_tokens=5, user="alice")
            usage.append(r.usage.prompt_tokens)
        s.drained()
        queries, hits = _metric(s.url, QUERIES), _metric(s.url, HITS)
    assert queries == sum(usage)  # each request looked up once, at its admission
    shared_blocks = len(WordTokenizer().encode(f"system: {SYSTEM}\n")) // 16
    assert hits >= 2 * shared_blocks * 16  # the second and third found the system prompt's blocks
    assert 0 < hits / queries < 1


def test_with_prefix_caching_off_the_counters_are_there_and_zero(srv_off):
    srv_off.openai().completions.create(model="batch-sim", prompt=SYSTEM, max_tokens=3)
    srv_off.drained()
    text = httpx.get(f"{srv_off.url}/metrics").text
    assert f"{QUERIES} 0.0" in text and f"{HITS} 0.0" in text


@pytest.fixture(scope="module")
def srv_off():
    with LiveServer(ServerConfig(trust_user_field=True), seed=3) as s:
        yield s


def test_serve_has_a_prefix_caching_flag_the_replicas_refuse(capsys):
    from batch.server import serve

    engine, _, _ = serve.build_engine(prefix_caching=True)
    assert engine.scheduler.config.prefix_caching
    assert not serve.build_engine()[0].scheduler.config.prefix_caching  # off by default, as Scheduler()
    with pytest.raises(SystemExit) as e:
        serve.main(["--replicas", "2", "--prefix-caching"])
    assert e.value.code == 2 and "--prefix-caching" in capsys.readouterr().err
