"""The import contract as an outside harness meets it: constructor knobs refused at construction,
numpy numbers in requests, knobs, backend answers and ``request_gen.stream``'s arguments, the
main job's argument errors, and request ids repeated across users."""
from __future__ import annotations

import numpy as np
import pytest

import request_gen
from conftest import ScriptedBackend, drain, make_req
from inference_stub import Request
from scheduler import InvalidRequestError, Scheduler


@pytest.mark.parametrize("knob", [
    {"clock": 5}, {"clock": "time"}, {"backend": 5}, {"policy": 5}, {"policy": "fcfs"},
    {"eos_token_id": "x"}, {"eos_token_id": True}, {"eos_token_id": 1.0}, {"vocab_size": 0}, {"vocab_size": "64"},
    {"isolation": 5}, {"isolation": "yes"}, {"record_itl": "no"}, {"check_invariants": "x"},
    {"admission_headroom": "x"},
])
def test_constructor_refuses_a_malformed_knob(knob):
    """A malformed knob is refused at construction (ValueError naming it), not at the first submit or tick."""
    with pytest.raises(ValueError, match=next(iter(knob))):
        Scheduler(**knob)


def test_a_refused_knob_was_not_a_later_half_applied_submit():
    """Before the fix ``Scheduler(policy=5).submit(r)`` raised AttributeError after indexing r: a
    retry of the same request then failed with DuplicateRequestError. The constructor refuses it now."""
    with pytest.raises(ValueError):
        Scheduler(policy=5)


def test_numpy_integers_in_a_request_are_accepted():
    """A harness that draws lengths with numpy passes ``np.int64`` max_tokens and prompt ids; the
    stub's forward and kv_blocks_for work on them, so the scheduler accepts them too."""
    b = ScriptedBackend()
    s = Scheduler(backend=b)
    r = Request(user_id="u1", prompt=list(np.arange(70, dtype=np.int64) % 63 + 1), max_tokens=np.int64(5), request_id="n")
    s.submit(r)
    assert type(r.max_tokens) is int and r.max_tokens == 5  # a plain int inside the scheduler
    assert drain(s) == [r]
    assert len(r.generated) == 5


@pytest.mark.parametrize("max_tokens, token", [(np.float64(5.0), np.float64(5.0)), (np.bool_(True), np.bool_(True)),
                                               (np.int64(0), np.int64(-1))])
def test_numpy_non_integers_and_out_of_range_stay_refused(max_tokens, token):
    s = Scheduler(backend=ScriptedBackend())
    with pytest.raises(InvalidRequestError):
        s.submit(Request(user_id="u1", prompt=[1, 2], max_tokens=max_tokens))
    with pytest.raises(InvalidRequestError):
        s.submit(Request(user_id="u1", prompt=[1, token], max_tokens=3))
    assert not s.has_active() and s.metrics()["refusals"] == 2


def test_a_backend_answering_a_numpy_array_is_applied():
    """``forward`` of a real model may answer ``logits.argmax(-1)`` as an array: one int per request."""
    inner = ScriptedBackend()
    s = Scheduler(backend=lambda batch: np.asarray(inner(batch), dtype=np.int64))
    rs = [make_req(f"a{i}", max_tokens=4) for i in range(3)]
    for r in rs:
        s.submit(r)
    assert len(drain(s)) == 3
    assert all(len(r.generated) == 4 and all(type(t) is int for t in r.generated) for r in rs)


def test_numpy_integer_eos_and_vocab_size_are_accepted_as_before_the_knob_checks():
    """``Scheduler(eos_token_id=np.int64(2), vocab_size=np.int64(64))`` worked before the
    constructor checks (the values are only compared); the checks refused it. Accepted again,
    stored as plain ints; a bool or a negative id stays refused."""
    np = pytest.importorskip("numpy")
    b = ScriptedBackend(eos_at={"e": 3})
    s = Scheduler(backend=b, eos_token_id=np.int64(0), vocab_size=np.int64(64))
    assert type(s.config.eos_token_id) is int and type(s.vocab_size) is int
    r = make_req("e", max_tokens=10)
    s.submit(r)
    assert drain(s) == [r] and len(r.generated) == 3 and r.generated[-1] == 0
    for bad in ({"eos_token_id": np.bool_(True)}, {"eos_token_id": np.float64(0.0)}, {"vocab_size": np.int64(0)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Scheduler(**bad)


@pytest.mark.parametrize("kw", [{"lam": 0.0}, {"lam": -1.0}, {"lam": float("nan")}, {"lam": float("inf")},
                                {"n": -5}, {"n": 2.5}, {"n": True}, {"lam": "5"}])
def test_stream_refuses_a_malformed_argument(kw):
    """``stream(lam=-1)`` returned decreasing, negative arrival offsets and ``lam=0`` a ZeroDivisionError."""
    with pytest.raises(ValueError, match=next(iter(kw))):
        request_gen.stream(**kw)


def test_stream_unchanged_for_valid_arguments():
    rs = request_gen.stream(n=3, lam=2, seed=1)  # an int rate is a rate
    assert [r.request_id for r in rs] == ["r0", "r1", "r2"] and request_gen.stream(n=0) == []
    assert [r.prompt for r in rs] == [r.prompt for r in request_gen.stream(n=3, lam=2.0, seed=1)]


def test_stream_takes_numpy_numbers_as_before_its_argument_checks():
    """``stream(n=np.int64(3), lam=np.float32(2.5))`` worked before the argument checks and was
    refused by them; accepted again, with plain-float arrival offsets."""
    np = pytest.importorskip("numpy")
    got = request_gen.stream(n=np.int64(3), lam=np.float32(2.5), seed=1)
    assert [(r.request_id, r.submitted_at) for r in got] == [
        (r.request_id, r.submitted_at) for r in request_gen.stream(n=3, lam=2.5, seed=1)]
    assert all(type(r.submitted_at) is float for r in got)
    for bad in ({"n": np.float64(3.0)}, {"n": np.int64(-1)}, {"lam": np.float64("nan")}, {"lam": np.bool_(True)}):
        with pytest.raises(ValueError):
            request_gen.stream(**bad)


@pytest.mark.parametrize("argv", [["--trace", "no-such-trace.csv"], ["--n", "-5"], ["--rate", "0"], ["--rate", "nan"],
                                  ["--kv-cap-blocks", "0"], ["--eos-probability", "2"], ["--limit", "-1"]])
def test_main_job_refuses_bad_arguments_with_a_usage_error(argv, capsys):
    """``python -m batch --trace missing.csv`` or ``--rate 0`` ended in a traceback (FileNotFoundError,
    ZeroDivisionError); ``--rate -1`` ran with negative arrival offsets. Now one ``batch: error:`` line."""
    from batch import cli
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--no-progress", "--clock", "virtual"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("batch: error:")


def test_ab_burst_with_ids_repeated_across_users_runs_every_request():
    """A harness may number user A's and user B's requests alike (``str(i)`` in two loops):
    every request is accepted, runs once and finishes; the cap holds throughout."""
    b = ScriptedBackend()
    s = Scheduler(backend=b, check_invariants=True)
    reqs = [make_req(str(i), user="A", n_prompt=40, max_tokens=8) for i in range(30)]
    reqs += [make_req(str(i), user="B", n_prompt=10, max_tokens=4) for i in range(5)]
    for r in reqs:
        s.submit(r)
    done = drain(s)
    assert sorted(map(id, done)) == sorted(map(id, reqs))
    assert all(len(r.generated) == r.max_tokens for r in reqs) and not s.state.by_id
