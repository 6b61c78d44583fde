"""What a decode step costs on this model and device, learnt online from the steps themselves.

Pure (no llama.cpp, no clock): the worker times each step and tells :meth:`StepCosts.observe`;
the scheduler asks :meth:`StepCosts.predict` how long a step it is planning would take, to cut
its prompt tokens to fit the running sequences' time per output token.

A step of ``tokens`` tokens, ``sampled`` of which have their logits computed and a token
sampled (every generating sequence's, and the last of each prompt that ends in the step), over
a KV cache holding ``cells`` cells, is modelled as::

    seconds = c_step + c_token * tokens + c_sample * sampled + c_attend * tokens * cells / 1024

* ``c_step``: what a step costs whatever is in it (building the graph, reading the weights
  once, the step's event to the daemon);
* ``c_token``: each token through the layers (on a CPU the bulk: every token costs about the
  same, alone or in a batch; on a GPU little);
* ``c_sample``: the output layer over the vocabulary and the sampler chain, per sampled token;
* ``c_attend``: attention, per token and per cell it attends over (llama.cpp's unified cache
  masks, but computes, every cell in use for every token of the step).

The coefficients are a least-squares fit over the steps observed, each weighted by ``DECAY`` **
(steps since), so that about the last ``1 / (1 - DECAY)`` steps count and the fit follows the
machine as it warms, or as other work takes its cores. A prior (``PRIOR_STEPS`` steps' worth, at
typical features) pulls it towards ``prior`` where the steps seen do not tell the coefficients
apart; no coefficient may go negative (a fit that would have one is refitted without it). A
step far slower than predicted (a page fault storm, another process taking the core) counts as
at most ``OUTLIER`` times the prediction, so one hiccup cannot make every later step look dear.

**How far it errs.** A fit predicts the mean; a stream whose tokens are due is hurt by the steps
that run long, and the error is not the same for every size of step (on the embedded model, on a
CPU, past capacity, steps of a decode or two ran a fifth under the fit at the median, while one
step in ten of 16 to 255 tokens ran more than 1.16 to 1.33 times over it). So steps are sorted
by their tokens into bins of powers of 4 (1 to 3, 4 to 15, 16 to 63, 64 to 255, more), and
each bin's *spread* is the ``SPREAD_QUANTILE`` quantile of the ratio of a step's seconds to its
prediction over its last ``SPREAD_STEPS`` steps (at least 1; a bin of fewer than
``SPREAD_AFTER`` steps takes the largest spread of the others). :meth:`StepCosts.predict_high`
is the prediction times its bin's spread: what the scheduler plans a step to, so that about
nine steps in ten end by the time planned.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

DECAY = 0.95
PRIOR_STEPS = 0.5
OUTLIER = 1.5
SPREAD_BINS = 5
SPREAD_STEPS = 32
SPREAD_QUANTILE = 0.9
SPREAD_AFTER = 8
# Typical features of a step, the scale of the prior: (1, tokens, sampled, tokens x cells / 1024).
SCALE = (1.0, 32.0, 4.0, 32.0)
# A first guess at a CPU (seconds): 2 ms a step, 3 ms a token, 0.5 ms a sampled token, nothing
# for attention. The worker's warm-up steps replace it within a few steps of starting.
DEFAULT_PRIOR = (0.002, 0.003, 0.0005, 0.0)
N = len(SCALE)


def features(tokens: int, sampled: int, cells: int) -> tuple[float, float, float, float]:
    return (1.0, float(tokens), float(sampled), tokens * cells / 1024)


class StepCosts:
    """The online fit of a step's seconds (see the module docstring)."""

    __slots__ = ("_a", "_b", "_known", "_ratios", "coefficients", "observed", "prior", "spreads")

    def __init__(self, prior: Sequence[float] = DEFAULT_PRIOR) -> None:
        if len(prior) != N or any(c < 0 for c in prior):
            raise ValueError(f"a prior is {N} coefficients, none negative")
        self.prior = tuple(float(c) for c in prior)
        self.coefficients = self.prior
        self.observed = 0
        # The weighted normal equations without the prior: A = sum w x x', b = sum w x y.
        self._a = [[0.0] * N for _ in range(N)]
        self._b = [0.0] * N
        self._ratios = [deque[float](maxlen=SPREAD_STEPS) for _ in range(SPREAD_BINS)]
        self._known: dict[int, float] = {}  # the spreads of the bins of SPREAD_AFTER steps
        self.spreads = [1.0] * SPREAD_BINS  # each bin's (see the module docstring)

    def predict(self, tokens: int, sampled: int, cells: int) -> float:
        x = features(tokens, sampled, cells)
        return sum(c * v for c, v in zip(self.coefficients, x, strict=True))

    def predict_high(self, tokens: int, sampled: int, cells: int) -> float:
        """The prediction times its bin's spread: about nine such steps in ten end within it."""
        return self.spreads[_bin(tokens)] * self.predict(tokens, sampled, cells)

    def per_token(self, cells: int) -> float:
        """What one more prompt token adds to a step over ``cells`` cells (at least a
        microsecond: a step never grows for free)."""
        c = self.coefficients
        return max(c[1] + c[3] * cells / 1024, 1e-6)

    def decode(self, streams: int, cells: int) -> float:
        """A step of ``streams`` streams that each get a token, over ``cells`` cells: what a
        generated token of one of them costs (at least a microsecond)."""
        return max(self.predict(streams, streams, cells), 1e-6)

    def observe(self, tokens: int, sampled: int, cells: int, seconds: float) -> None:
        """A step that ran: its features and how long it took."""
        if tokens < 1 or not seconds > 0:
            return
        if self.observed:
            predicted = max(self.predict(tokens, sampled, cells), 1e-6)
            seconds = min(seconds, OUTLIER * predicted)
            self._spread(_bin(tokens), seconds / predicted)
        self.observed += 1
        x = features(tokens, sampled, cells)
        a, b = self._a, self._b
        for i in range(N):
            row = a[i]
            for j in range(N):
                row[j] = DECAY * row[j] + x[i] * x[j]
            b[i] = DECAY * b[i] + x[i] * seconds
        self.coefficients = self._solve()

    def _spread(self, size: int, ratio: float) -> None:
        ratios = self._ratios[size]
        ratios.append(ratio)
        if len(ratios) < SPREAD_AFTER:
            return
        ranked = sorted(ratios)
        self._known[size] = max(1.0, ranked[int(SPREAD_QUANTILE * (len(ranked) - 1))])
        others = max(self._known.values())
        self.spreads = [self._known.get(i, others) for i in range(SPREAD_BINS)]

    def _solve(self) -> tuple[float, ...]:
        """The fit with the prior, every coefficient at least 0: features whose coefficient
        would be negative are left out (held at 0) and the rest refitted."""
        active = list(range(N))
        while True:
            ridge = [PRIOR_STEPS / (SCALE[i] * SCALE[i]) for i in range(N)]
            m = [[self._a[i][j] + (ridge[i] if i == j else 0.0) for j in active] for i in active]
            v = [self._b[i] + ridge[i] * self.prior[i] for i in active]
            solved = _gauss(m, v)
            if solved is None:
                return self.coefficients
            negative = [k for k, c in enumerate(solved) if c < 0]
            if not negative:
                out = [0.0] * N
                for k, i in enumerate(active):
                    out[i] = solved[k]
                return tuple(out)
            active = [i for k, i in enumerate(active) if k not in negative]
            if not active:
                return (0.0,) * N


def _bin(tokens: int) -> int:
    """A step's spread bin: 1 to 3 tokens, 4 to 15, 16 to 63, 64 to 255, more."""
    return min((max(tokens, 1).bit_length() - 1) // 2, SPREAD_BINS - 1)


def _gauss(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve ``m x = v`` by Gaussian elimination with partial pivoting (None: singular)."""
    n = len(v)
    rows = [[*m[i], v[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        top = rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / top[col]
            if factor:
                row = rows[r]
                for k in range(col, n + 1):
                    row[k] -= factor * top[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = rows[r]
        x[r] = (row[n] - sum(row[k] * x[k] for k in range(r + 1, n))) / row[r]
    return x
