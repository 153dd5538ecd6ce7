"""A real model under Batch: a tiny seeded Llama (2 layers, hidden 64, vocabulary 256) on the paged KV cache.

The property: every request's tokens under Batch (continuous batching, chunked prefill, a
token budget that splits chunks at odd sizes, staggered arrivals, preemption by recompute)
equal the tokens of the same request run alone through plain transformers (whole prompt,
then one token at a time, in a fresh ``DynamicCache``), and so do the logits, to 1e-9, in
float64. Freed blocks are filled with NaN, so a stale read turns the logits into NaN. Each
scenario asserts that it exercised the paths it is about.

Needs the ``model`` extra (torch, transformers); skipped when it is not installed.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs the 'model' extra: pip install -e '.[dev,model]'")
pytest.importorskip("transformers", reason="needs the 'model' extra: pip install -e '.[dev,model]'")

from conftest import StepClock, drain, make_req  # noqa: E402

torch.set_num_threads(1)  # tiny ops: intra-op threads only spin, and stall when the 2 cores are shared

from batch.backends.model_backend import ModelBackend, PagedKVCache, tiny_llama  # noqa: E402
from batch.core.backend_api import BatchItem  # noqa: E402
from batch.policies.policy import FCFSPolicy  # noqa: E402
from inference_stub import Request  # noqa: E402
from scheduler import BackendError, InvalidRequestError, Scheduler  # noqa: E402

#: The tiny model's EOS id: a token its greedy outputs reach, so some requests stop on EOS.
EOS = 102
DTYPE = torch.float64
LOGIT_TOL = 1e-9  # float64 batched vs alone differ by ~1e-15; a wrong KV read moves logits by ~1e-2
MIN_MARGIN = 1e-6  # the reference's top-1 minus top-2 logit is never closer than this


def model():
    return tiny_llama(seed=0, dtype=DTYPE, eos_token_id=EOS)


@pytest.fixture(scope="module")
def ref_model():
    return model()


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@torch.inference_mode()
def alone(ref, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """The request run alone with plain transformers: whole prompt, then one token at a time (fresh cache).

    Returns the greedy tokens (stopping at EOS or ``max_tokens``) and the logits row of each.
    Asserts the top-1/top-2 margin is never tiny, so a tie cannot pass for a bug.
    """
    out = ref(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens, rows = [], []
    while True:
        row = out.logits[0, -1]
        top2 = row.topk(2).values
        assert top2[0] - top2[1] > MIN_MARGIN, f"near-tie in the reference after {len(tokens)} tokens"
        t = int(row.argmax())
        tokens.append(t)
        rows.append(row)
        if t == EOS or len(tokens) >= max_tokens:
            return tokens, rows
        out = ref(input_ids=torch.tensor([[t]]), cache=out.cache, use_cache=True)


class Recorder:
    """Wraps a backend's ``execute_model`` and keeps every iteration's items."""

    def __init__(self, inner: ModelBackend) -> None:
        self.inner = inner
        self.calls: list[list[BatchItem]] = []

    def execute_model(self, items):
        self.calls.append(items)
        return self.inner.execute_model(items)


def new_scheduler(*, num_blocks: int, budget_tokens: int | None = None, poison: bool = True, policy="fcfs"):
    """A scheduler on a fresh tiny model; returns it, the recorder of its iterations and the backend.

    The scenarios engineer their preemption points with FCFS's victim rule (newest admitted) and
    no admission headroom, so ``policy="fcfs"`` is the default; ``policy=None`` runs the
    default fair policy.
    """
    backend = ModelBackend(model(), num_blocks=num_blocks, poison_freed_blocks=poison, record_logits=True)
    rec = Recorder(backend)
    kw = backend.scheduler_kwargs() | {"backend": rec}
    if policy == "fcfs":
        kw |= {"policy": FCFSPolicy(), "admission_headroom": False}
    sched = backend.attach(Scheduler(**kw, token_budget_tokens=budget_tokens, clock=StepClock()))
    return sched, rec, backend


def run_batch(workload, *, num_blocks: int, budget_tokens: int | None = None, poison: bool = True,
              before_tick=None, policy="fcfs"):
    """Run ``workload`` (``(arrival_tick, Request)`` pairs) through Batch on the tiny model.

    ``before_tick(sched, backend)`` runs before every tick. Returns the scheduler, the recorder and the
    backend; checks the KV ledger after every tick.
    """
    sched, rec, backend = new_scheduler(num_blocks=num_blocks, budget_tokens=budget_tokens, poison=poison,
                                        policy=policy)
    pending = sorted(workload, key=lambda w: w[0])
    tick = 0
    while pending or sched.has_active():
        while pending and pending[0][0] <= tick:
            sched.submit(pending.pop(0)[1])
        if sched.has_active():
            if before_tick:
                before_tick(sched, backend)
            sched.tick()
            sched.check_integrity()
        tick += 1
        assert tick < 5000
    return sched, rec, backend


def assert_batched_equals_alone(ref, requests, backend) -> None:
    for r in requests:
        want, rows = alone(ref, r.prompt, r.max_tokens)
        assert r.generated == want, f"{r.request_id}: batched {r.generated} != alone {want}"
        got = backend.logits[r.request_id]  # one row per kept token: recompute samples only its last token
        assert len(got) == len(want)
        diff = max(float((g - w).abs().max()) for g, w in zip(got, rows))
        assert diff < LOGIT_TOL, f"{r.request_id}: logits differ by {diff}"


def preemption_points(rec: Recorder) -> dict[str, list[int]]:
    """Per request: the tokens it had computed each time it was preempted (seen as a restart at 0)."""
    reached: dict[str, int] = {}
    points: dict[str, list[int]] = {}
    for items in rec.calls:
        for it in items:
            rid = it.request.request_id
            if it.num_computed_tokens == 0 and reached.get(rid, 0) > 0:
                points.setdefault(rid, []).append(reached[rid])
            reached[rid] = it.num_computed_tokens + len(it.token_ids)
    return points


def is_prefill(it: BatchItem) -> bool:
    return it.num_computed_tokens < len(it.request.prompt)


def is_decode(it: BatchItem) -> bool:
    return len(it.token_ids) == 1 and it.sample and not is_prefill(it)


# ---------------------------------------------------------------- the scenarios


def staggered_workload(n: int = 12):
    """Prompts 7..190 tokens (several chunks), outputs up to 60 tokens, arrivals every 3 ticks."""
    out = []
    for i in range(n):
        n_prompt = 7 + (i * 53) % 184
        out.append((3 * i, Request(user_id=f"u{i % 3}", prompt=prompt_of(i, n_prompt), max_tokens=20 + (i * 17) % 41,
                                   request_id=f"r{i}")))
    return out


@pytest.mark.parametrize("num_blocks, budget_tokens, n_requests, policy", [
    (24, 90, 12, "fcfs"), (16, 37, 12, "fcfs"), (20, 61, 16, "fcfs"), (16, 37, 16, None)])
def test_batched_equals_alone_under_chunking_budget_splits_and_preemption(ref_model, num_blocks, budget_tokens,
                                                                          n_requests, policy):
    workload = staggered_workload(n_requests)
    sched, rec, backend = run_batch(workload, num_blocks=num_blocks, budget_tokens=budget_tokens, policy=policy)
    reqs = [r for _, r in workload]
    assert all(len(r.prompt) + r.max_tokens < num_blocks * 16 for r in reqs)  # the length limit never binds
    assert_batched_equals_alone(ref_model, reqs, backend)
    m = sched.metrics()
    assert m["preemptions"] > 0
    assert m["finish_reasons"].get("stop", 0) > 0 and m["finish_reasons"].get("length", 0) > 0
    assert m["kv_blocks_in_use"] == 0 and sched.pool.num_free == num_blocks
    items = [it for call in rec.calls for it in call]
    assert any(not it.sample and len(it.token_ids) < 64 for it in items), "no chunk cut short by the budget"
    assert any(any(map(is_prefill, call)) and any(map(is_decode, call)) for call in rec.calls), "no mixed iteration"


def two_requests(*, prompt_a: int, prompt_b: int, arrival_b: int, max_a: int, max_b: int):
    return [(0, Request(user_id="a", prompt=prompt_of(100 + prompt_a, prompt_a), max_tokens=max_a, request_id="A")),
            (arrival_b, Request(user_id="b", prompt=prompt_of(200 + prompt_b, prompt_b), max_tokens=max_b,
                                request_id="B"))]


def test_recompute_after_preemption_at_a_block_boundary(ref_model):
    # 6 blocks: when A (48 tokens) needs its 4th block, B holds 3 with exactly 32 tokens computed.
    workload = two_requests(prompt_a=10, prompt_b=15, arrival_b=20, max_a=60, max_b=40)
    sched, rec, backend = run_batch(workload, num_blocks=6)
    assert preemption_points(rec) == {"B": [32]}  # decoding, KV ending exactly at a block's end
    assert_batched_equals_alone(ref_model, [r for _, r in workload], backend)
    assert sched.pool.num_free == 6


def test_recompute_after_preemption_at_a_chunk_boundary(ref_model):
    # 11 blocks: B's 150-token prompt reserves 10; A's growth preempts B after its first 64-token chunk.
    # B then waits, blocked, gets the reservation after aging_ticks (32) and takes A's room (the
    # holder may take any resident's), A having 48 tokens computed: A recomputes too.
    workload = two_requests(prompt_a=10, prompt_b=150, arrival_b=5, max_a=60, max_b=20)
    sched, rec, backend = run_batch(workload, num_blocks=11)
    assert preemption_points(rec) == {"B": [64], "A": [48]}  # B mid-prefill, between two chunks
    assert_batched_equals_alone(ref_model, [r for _, r in workload], backend)
    assert sched.pool.num_free == 11


@torch.inference_mode()
def test_paged_cache_matches_a_cache_free_full_recompute(ref_model):
    workload = [(0, Request(user_id="a", prompt=prompt_of(1, 150), max_tokens=12, request_id="a")),
                (1, Request(user_id="b", prompt=prompt_of(2, 40), max_tokens=30, request_id="b")),
                (4, Request(user_id="c", prompt=prompt_of(3, 70), max_tokens=20, request_id="c"))]
    sched, rec, backend = run_batch(workload, num_blocks=64, budget_tokens=70)
    for _, r in workload:
        seq = r.prompt + r.generated
        full = ref_model(input_ids=torch.tensor([seq[:-1]]), use_cache=False).logits[0]  # no cache at all
        want = full[len(r.prompt) - 1:]  # the rows that predicted each generated token
        got = torch.stack(backend.logits[r.request_id])
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < LOGIT_TOL
        assert want.argmax(dim=-1).tolist() == r.generated


def test_failed_iteration_leaves_the_cache_unchanged_and_the_retry_matches_alone(ref_model):
    workload = two_requests(prompt_a=10, prompt_b=150, arrival_b=5, max_a=60, max_b=20)
    failed = []

    def fail_the_preempting_tick_once(sched, backend):
        if failed or not sched.schedule().preempted:
            return
        cache = backend.cache
        before = [t.clone() for t in cache.k + cache.v]
        tables = [list(s.block_table) for s in sched.running]

        def device_lost(*_):
            raise RuntimeError("device lost")

        hook = backend.model.model.layers[1].register_forward_pre_hook(device_lost)  # after layer 0 ran
        try:
            with pytest.raises(BackendError, match="device lost"):
                sched.tick()
        finally:
            hook.remove()
        failed.append(True)
        assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v)), "layer 0 wrote KV"
        assert [list(s.block_table) for s in sched.running] == tables

    sched, rec, backend = run_batch(workload, num_blocks=11, poison=False, before_tick=fail_the_preempting_tick_once)
    assert failed and sched.metrics()["preemptions"] == 2  # B's, retried once, then A's for the holder B
    assert_batched_equals_alone(ref_model, [r for _, r in workload], backend)


def test_simulate_runs_a_workload_on_the_model_backend(capsys):
    from batch import cli

    assert cli.main(["--backend", "model", "--n", "6", "--rate", "1000", "--kv-cap-blocks", "24",
                     "--token-budget", "100"]) == 0
    out = capsys.readouterr().out
    assert "model backend: LlamaForCausalLM (2 layers, hidden 64" in out
    assert "requests finished                  6" in out and "KV cap 24 blocks" in out


def test_backend_refuses_a_mismatched_scheduler_and_a_short_block_table():
    backend = ModelBackend(model(), num_blocks=8)
    with pytest.raises(ValueError, match="8 of 16"):
        backend.attach(Scheduler(backend=backend, kv_cap_blocks=9))
    r = Request(user_id="u", prompt=prompt_of(0, 20), max_tokens=2, request_id="x")
    with pytest.raises(ValueError, match="cannot hold 20 tokens"):
        backend.execute_model([BatchItem(r, tuple(r.prompt), 0, (0,), True)])
    with pytest.raises(ValueError, match="outside the pool"):
        backend.execute_model([BatchItem(r, tuple(r.prompt), 0, (0, 8), True)])
    assert all(float(t.abs().sum()) == 0 for t in backend.cache.k + backend.cache.v)  # nothing written


def test_the_model_vocabulary_bounds_prompt_ids_at_submit_with_a_typed_error():
    """The stub takes any id >= 0; a real model's ids must lie in its vocabulary (256 here), with
    ``make_scheduler`` and with a plain ``Scheduler(backend=...)`` alike."""
    backend = ModelBackend(model(), num_blocks=8)
    for s in (backend.make_scheduler(), Scheduler(backend=backend, kv_cap_blocks=8)):
        with pytest.raises(InvalidRequestError, match="0..255"):
            s.submit(Request(user_id="u", prompt=[1, 256], max_tokens=2, request_id="x"))
        assert not s.has_active()
        s.submit(Request(user_id="u", prompt=[0, 255], max_tokens=2, request_id="ok"))
        done = []
        while s.has_active():
            done += s.tick()
        assert [r.request_id for r in done] == ["ok"]


def test_a_model_without_an_eos_id_does_not_stop_on_token_zero():
    """``ModelBackend`` for a model without an EOS id gave the scheduler ``eos_token_id=None``,
    which means the stub's EOS (token 0): the model's token 0 then ended every request."""
    model = tiny_llama(seed=0, eos_token_id=None)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit ties at 0: greedy answers token 0 every time
    backend = ModelBackend(model, num_blocks=8, block_tokens=4)
    assert backend.eos_token_id is None
    s = backend.make_scheduler(clock=StepClock())
    r = make_req("r0", n_prompt=5, max_tokens=6)
    s.submit(r)
    drain(s)
    assert r.generated == [0] * 6
    assert s.metrics()["finish_reasons"] == {"length": 1}


def test_paged_kv_cache_layout_and_poison():
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_tokens=16, kv_heads=2, head_dim=8, dtype=DTYPE,
                         device="cpu")
    assert cache.slots((3, 1), 14, 18).tolist() == [62, 63, 16, 17]
    cache.poison([1])
    assert torch.isnan(cache.k[0][1]).all() and not torch.isnan(cache.k[0][0]).any()
    with pytest.raises(ValueError):
        PagedKVCache(num_layers=0, num_blocks=4, block_tokens=16, kv_heads=2, head_dim=8, dtype=DTYPE, device="cpu")


def test_a_local_checkpoint_directory_loads_and_matches_alone(ref_model, tmp_path):
    from batch.backends.model_backend import from_cli

    model().save_pretrained(tmp_path)  # config.json + model.safetensors, as a downloaded checkpoint has
    backend = from_cli(path=str(tmp_path), dtype="float64", num_blocks=16)
    assert backend.eos_token_id == EOS and backend.vocab_size == 256
    sched = backend.make_scheduler(clock=StepClock())
    r = Request(user_id="u", prompt=prompt_of(9, 100), max_tokens=25, request_id="ckpt")
    sched.submit(r)
    while sched.has_active():
        sched.tick()
    assert r.generated == alone(ref_model, r.prompt, r.max_tokens)[0]
    with pytest.raises(FileNotFoundError):
        from_cli(path=str(tmp_path / "missing"))
