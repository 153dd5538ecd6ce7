"""The learned iteration-latency model: iteration time = a + b * requests + c * batched tokens,
fitted online from the scheduler's own ``forward`` durations (used by ``Isolation``)."""
from __future__ import annotations

import math
from typing import Sequence


class LatencyModel:
    """Iteration time = a + b * requests + c * batched tokens, least squares fitted online.

    Each observation is one ``forward`` call: requests in the batch, tokens processed
    (prefill chunks + decodes) and its duration in seconds on the scheduler's clock. Old
    observations decay by ``forgetting`` per observation; a small ridge keeps the solve defined.

    The fit is used once it is *identified*: at least ``min_observations`` observations, the
    batch size and the batched tokens each varied (weighted standard deviation >= 1) and not
    in lockstep (|correlation| <= 0.99; decode-only batches have tokens == requests). Until
    then ``predict_s`` uses the prior, cost proportional to requests: the isolation it then
    chooses is itself the observation (a small batch) that identifies the fit.

    Args:
        forgetting: weight kept by past observations per new one, in (0, 1].
        min_observations: observations needed before the fit may be used.
        prior_per_request_s: the prior's cost of one request, seconds.
        ridge: relative ridge on the request and token coefficients.

    Raises:
        ValueError: a parameter is out of range.
    """

    def __init__(self, *, forgetting: float = 0.999, min_observations: int = 8,
                 prior_per_request_s: float = 1e-3, ridge: float = 1e-6) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must lie in (0, 1], got {forgetting}")
        if min_observations < 1 or prior_per_request_s <= 0 or ridge < 0:
            raise ValueError("min_observations >= 1, prior_per_request_s > 0 and ridge >= 0 are required")
        self.forgetting = forgetting
        self.min_observations = min_observations
        self.prior_per_request_s = prior_per_request_s
        self.ridge = ridge
        self.observations = 0
        self._s = [0.0] * 6  # sum x x^T, upper triangle of (1, n, t): 11 1n 1t nn nt tt
        self._v = [0.0] * 3  # sum x y
        self._coef: tuple[float, float, float] | None = None

    def observe(self, n_requests: int, n_tokens: int, duration_s: float) -> None:
        """Record one iteration of ``n_requests`` requests and ``n_tokens`` tokens taking ``duration_s``.

        A duration that is negative (a clock that went back), NaN or infinite is ignored: one
        infinite duration would turn the fit into NaN for good.
        """
        if n_requests <= 0 or not 0.0 <= duration_s < math.inf:
            return
        f = self.forgetting
        s, v = self._s, self._v
        n, t, y = float(n_requests), float(n_tokens), float(duration_s)
        s[0] = f * s[0] + 1.0
        s[1] = f * s[1] + n
        s[2] = f * s[2] + t
        s[3] = f * s[3] + n * n
        s[4] = f * s[4] + n * t
        s[5] = f * s[5] + t * t
        v[0] = f * v[0] + y
        v[1] = f * v[1] + n * y
        v[2] = f * v[2] + t * y
        self.observations += 1
        self._coef = None

    @property
    def ready(self) -> bool:
        """Whether the fit is identified (see the class docstring) and used by ``predict_s``."""
        if self.observations < self.min_observations:
            return False
        s = self._s
        mn, mt = s[1] / s[0], s[2] / s[0]
        var_n, var_t = s[3] / s[0] - mn * mn, s[5] / s[0] - mt * mt
        if var_n < 1.0 or var_t < 1.0:
            return False
        cov = s[4] / s[0] - mn * mt
        return cov * cov <= 0.98 * var_n * var_t

    def coefficients(self) -> tuple[float, float, float]:
        """``(a seconds, b seconds per request, c seconds per token)``, each clamped at >= 0.

        Raises:
            RuntimeError: before ``min_observations`` observations.
        """
        if not self.ready:
            raise RuntimeError(f"{self.observations} observations, {self.min_observations} needed")
        if self._coef is None:
            s, v = self._s, self._v
            r = 1.0 + self.ridge
            sol = _solve3([[s[0], s[1], s[2]], [s[1], s[3] * r, s[4]], [s[2], s[4], s[5] * r]], v)
            self._coef = (max(0.0, sol[0]), max(0.0, sol[1]), max(0.0, sol[2]))
        return self._coef

    def predict_s(self, n_requests: int, n_tokens: int) -> float:
        """Predicted duration of an iteration, seconds (0 for an empty batch)."""
        if n_requests <= 0:
            return 0.0
        if not self.ready:
            return self.prior_per_request_s * n_requests
        a, b, c = self.coefficients()
        return a + b * n_requests + c * n_tokens

    def predict_us(self, n_requests: int, n_tokens: int) -> int:
        """``predict_s`` in integer microseconds (the unit of ``isolation_pays``)."""
        return int(round(self.predict_s(n_requests, n_tokens) * 1e6))


def _solve3(m: list[list[float]], v: Sequence[float]) -> tuple[float, float, float]:
    """Solve the 3x3 normal equations ``m x = v`` by Gaussian elimination with partial pivoting.

    ``m`` is the (ridged) Gram matrix of ``(1, requests, tokens)``; ``LatencyModel.ready``
    requires both regressors to vary and not to be collinear, so it is positive definite. A
    zero pivot (not reachable through ``ready``) gives 0 for that coefficient.
    """
    a = [list(row) + [float(b)] for row, b in zip(m, v)]
    for c in range(3):
        p = max(range(c, 3), key=lambda i: abs(a[i][c]))
        a[c], a[p] = a[p], a[c]
        if a[c][c] == 0.0:
            continue
        for i in range(c + 1, 3):
            f = a[i][c] / a[c][c]
            for j in range(c, 4):
                a[i][j] -= f * a[c][j]
    x = [0.0, 0.0, 0.0]
    for c in (2, 1, 0):
        if a[c][c] != 0.0:
            x[c] = (a[c][3] - sum(a[c][j] * x[j] for j in range(c + 1, 3))) / a[c][c]
    return x[0], x[1], x[2]
