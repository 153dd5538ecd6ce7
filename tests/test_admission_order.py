"""``VTCPolicy.order`` (heaps, a lazy walk) against a brute-force reference written from the rules
(``spec.fairness_rules``: ``vtc_eligible``, ``charged_counter``, ``lift_floor`` at
``LIFT_TOLERANCE_TOKENS``, ``lifted_counter``, ``idle_floor``, ``forgettable``; ``docs/design.md``,
"The tick", step 2): every waiting request of a light user first, by ``order_no``; then among the
other users within the tolerance of their least counter, the earliest head by ``order_no``. On
random sequences of arrivals, admissions (also past the first candidate), preemptions back to the
queue (a preempted decode takes a new ``order_no`` behind every arrival, as ``step.apply`` gives
it for a policy with ``requeue_behind``), aborts, charges, finishes and idle users, with tolerances
0..8192, weights, prices and random sets of light users; the order (with and without ``light``),
every lazy prefix of it, the counters, the lift floor and the waiting preempted decodes
(``resumable``) match."""
import random

import pytest

from batch.core.state import Seq
from batch.policies.vtc import VTCPolicy
from inference_stub import Request
from spec import fairness_rules as fr

S = fr.COUNTER_SCALE


def make_seq(user, arrival_no, n_prompt, max_tokens):
    req = Request(user_id=user, prompt=[1] * n_prompt, max_tokens=max_tokens, request_id=f"r{arrival_no}")
    return Seq(req=req, user_id=user, rid=req.request_id, arrival_no=arrival_no, num_prompt_tokens=n_prompt)


def cdiv(a, b):
    return -(-a // b)


class Ref:
    """The policy's rules, by brute force. ``active``: users with a request waiting or resident."""

    def __init__(self, T, weights, pp, op):
        self.T, self.w, self.pp, self.op = T * S, weights, pp, op
        self.lift_T = fr.LIFT_TOLERANCE_TOKENS * S  # the lift ignores the band
        self.c = {}
        self.floor = 0
        self.wait = {}  # user -> list of seqs (set semantics)
        self.active = set()
        self.decodes = set()  # waiting requests requeued with output tokens

    def weight(self, u):
        return self.w.get(u, 1)

    def _lift(self, u):
        others = [self.c.get(v, 0) for v in self.wait if v != u] or \
            [self.c.get(v, 0) for v in self.active if v != u]
        if others:
            self.floor = max(self.floor, min(others) - self.lift_T - 1)
        self.c[u] = max(self.c.get(u, 0), self.floor)
        self.active.add(u)

    def add(self, s):
        if s.user_id not in self.wait:
            self._lift(s.user_id)
        self.wait.setdefault(s.user_id, []).append(s)

    def requeue(self, s):
        self.add(s)
        if s.req.generated:
            self.decodes.add(s)

    def remove(self, s):
        self.decodes.discard(s)
        lst = self.wait[s.user_id]
        lst.remove(s)
        if not lst:
            del self.wait[s.user_id]

    def charge(self, u, p, o):
        self.c[u] = self.c.get(u, 0) + cdiv((self.pp * p + self.op * o) * S, self.weight(u))

    def on_idle(self, u):
        self.active.discard(u)
        if not self.active:  # nobody waiting or resident: everyone starts level
            self.floor = max(self.floor, max(self.c.values(), default=0))

    def order(self, light=None):
        light = light or (lambda u: False)
        T = self.T if len({self.weight(u) for u in self.wait}) <= 1 else 0  # the band: equal weights only
        local = {u: self.c.get(u, 0) for u in self.wait}
        heavy = [local[u] for u in self.wait if not light(u)]
        out, cut = [], set()
        for q in sorted((q for u, v in self.wait.items() if light(u) for q in v), key=lambda q: q.order_no):
            u = q.user_id
            if u in cut or (heavy and local[u] > min(heavy) + T):
                cut.add(u)  # ahead of the least heavy counter by more than T: the rest wait in the band
                continue
            out.append(q)
            local[u] += cdiv(self.pp * (q.num_prompt_tokens - q.prompt_charged_tokens) * S, self.weight(u))
        qs = {}
        for q in sorted((q for v in self.wait.values() for q in v), key=lambda q: q.order_no):
            if q not in out:
                qs.setdefault(q.user_id, []).append(q)
        while qs:
            least = min(local[u] for u in qs)
            elig = [u for u in qs if local[u] <= least + T]
            u = min(elig, key=lambda u: qs[u][0].order_no)
            s = qs[u].pop(0)
            out.append(s)
            local[u] += cdiv(self.pp * (s.num_prompt_tokens - s.prompt_charged_tokens) * S, self.weight(u))
            if not qs[u]:
                del qs[u]
        return out


def run(seed, steps=300):
    """One random run, compared after every step; True when every comparison held."""
    rng = random.Random(seed)
    T = rng.choice([0, 0, 1, 5, 20, 100, 1000, fr.TOLERANCE_TOKENS])
    nusers = rng.randint(1, 12)
    users = [f"u{i}" for i in range(nusers)]
    weights = {u: rng.randint(1, 16) for u in users if rng.random() < 0.4}
    pp, op = rng.choice([(1, 2), (1, 2), (0, 1), (3, 0)])
    pol = VTCPolicy(tolerance_tokens=T, weights=weights, prompt_price=pp, output_price=op)
    ref = Ref(T, weights, pp, op)
    arrival = 0
    waiting = []
    resident = []

    def maybe_idle(u):  # as the scheduler does: on_idle once the user has nothing waiting or resident
        if not any(q.user_id == u for q in waiting + resident):
            pol.on_idle(u)
            ref.on_idle(u)

    for step in range(steps):
        op_ = rng.random()
        if op_ < 0.35 or not waiting:
            s = make_seq(rng.choice(users), arrival, rng.randint(1, 200), rng.randint(1, 50))
            arrival += 1
            pol.add(s); ref.add(s); waiting.append(s)
        elif op_ < 0.55:
            # admit: the k-th of the order (admission may pass candidates that do not fit)
            order = list(pol.order())
            k = 0 if rng.random() < 0.7 else rng.randrange(len(order))
            s = order[k]
            pol.remove(s); ref.remove(s); waiting.remove(s); resident.append(s)
        elif op_ < 0.65 and resident:
            s = resident.pop(rng.randrange(len(resident)))
            s.prompt_charged_tokens = rng.choice([0, rng.randint(0, s.num_prompt_tokens), s.num_prompt_tokens])
            if rng.random() < 0.5:
                s.req.generated = [0] * rng.randint(1, 10)
            if pol.requeue_behind and s.req.generated:  # as step.apply does: behind every arrival so far
                s.order_no, arrival = arrival, arrival + 1
            waiting.append(s); pol.requeue(s); ref.requeue(s)
        elif op_ < 0.72:
            s = waiting.pop(rng.randrange(len(waiting)))  # aborted while waiting
            pol.remove(s); ref.remove(s)
            maybe_idle(s.user_id)
        elif op_ < 0.85 and resident:
            u = rng.choice(resident).user_id  # a user with a request in the batch is charged
            p, o = rng.randint(0, 100), rng.randint(0, 30)
            pol.charge(u, p, o); ref.charge(u, p, o)
        elif resident and op_ < 0.9:
            s = resident.pop(rng.randrange(len(resident)))  # finished (or aborted while resident)
            maybe_idle(s.user_id)
        # compare, with no light users and with a random set of them
        lights = set(rng.sample(users, rng.randint(0, nusers)))
        light = lights.__contains__
        for lt in (None, light):
            got, exp = list(pol.order() if lt is None else pol.order(lt)), ref.order(lt)
            assert got == exp, ("order", seed, step, T, sorted(lights) if lt else None, got[:10], exp[:10])
        got = list(pol.order(light))
        exp = ref.order(light)
        assert len(got) == len(set(map(id, got))), ("dup", seed, step, got)
        assert set(map(id, got)) == set(map(id, waiting)), ("set", seed, step)
        assert len(pol) == len(waiting), ("len", seed, step)
        assert pol.floor == ref.floor, ("floor", seed, step, pol.floor, ref.floor)
        for u in users:
            if u in ref.active:
                assert pol.counter(u) == ref.c.get(u, 0), ("counter", seed, step, u, pol.counter(u), ref.c.get(u, 0))
            else:  # an idle user may be forgotten: what its return would start from is the same
                assert fr.forgettable(pol.counter(u), pol.floor) or pol.counter(u) == ref.c.get(u, 0), \
                    ("idle counter", seed, step, u, pol.counter(u), ref.c.get(u, 0))
                assert max(pol.counter(u), pol.floor) == max(ref.c.get(u, 0), ref.floor), ("idle", seed, step, u)
        assert list(pol.resumable()) == sorted(ref.decodes, key=lambda q: q.order_no), ("resumable", seed, step)
        # lazy partial consumption equals prefix
        it = pol.order(light)
        k = rng.randint(0, len(exp))
        part = [next(it) for _ in range(k)]
        assert part == exp[:k]
    return True


@pytest.mark.parametrize("seed", range(80))
def test_admission_order_matches_the_brute_force_reference(seed):
    assert run(seed, steps=200)
