"""Exact draws for the usual sampling requests, from a row of logits, without llama.cpp's chain.

llama.cpp's sampler chain gives every draw passes over the whole vocabulary in scalar code (the
candidates copied out, then temperature, softmax and a running sum over each of them): 0.6 ms
a draw at SmolLM2's 49,152 tokens on this project's machine, 4.7 ms of a step that samples 8
streams at temperature 1 (llama-server's defaults, top_k 40 first, spend 0.8 ms). :class:`Draws`
takes the same distribution from the tokens that can matter:

- the **head**: the tokens within ``head`` (16) of the likeliest token's logit, in units of the
  temperature (at least 1). Each token outside it weighs at most e^-16 of the likeliest one, so
  together they weigh at most ``tail * e^-16`` of it (0.5 % at this vocabulary);
- the draw falls in the tail with the tail's share of the weight: a uniform that lands in what
  the bound leaves open is settled against the tail's real weight, and the token drawn from it;
- where min_p keeps tokens the head leaves out, the draw is made over every token;
- a head wider than a ``WIDE``-th of the vocabulary (a model unsure of its next token, as on a
  prompt of random words) is weighed whole, in place: one exp a token, in numpy's vector code.

8 draws at temperature 1 from a confident model's logits: 0.5 ms; one draw in a generation from
random words (heads of 26,000 tokens), 0.35 to 0.42 ms against the chain's 0.56 to 0.65 (`python
-m loadtest bench ceiling --sampling` measures both). The draws follow the chain's distribution (min_p,
temperature, then a draw, as llama.cpp's common sampler has them), not a truncated one; only
the random stream differs (numpy's, seeded by the same seed). Greedy (temperature 0) is the
chain's: the first likeliest token. Requests with logit biases, penalties, a grammar, top_k or
top_p (which sort the candidates: the chain does that faster) use the chain (:func:`plain`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from .messages import Run

HEAD = 16.0
WIDE = 8  # a head of more than a WIDE-th of the vocabulary is weighed as a whole
STRIDE = 16
BLOCK = 1024  # weights summed a block at a time to find where a draw falls

Logits = npt.NDArray[np.float32]
Ids = npt.NDArray[np.intp]


def penalties(request: Run) -> tuple[float, float, float]:
    """The request's repeat, frequency and presence penalties (NO_PENALTIES: none)."""
    return (request.repeat_penalty, request.frequency_penalty, request.presence_penalty)


NO_PENALTIES = (1.0, 0.0, 0.0)


def plain(request: Run) -> bool:
    """The request samples with nothing but a temperature and min_p (top_k and top_p sort
    the candidates: llama.cpp's chain does that faster)."""
    return (
        not request.logit_bias
        and not request.grammar
        and penalties(request) == NO_PENALTIES
        and request.top_k == 0
        and request.top_p >= 1
    )


class Draws:
    """One sequence's draws: its parameters and its random stream."""

    __slots__ = ("head", "min_p", "rng", "temperature")

    def __init__(
        self,
        *,
        temperature: float,
        min_p: float = 0.0,
        seed: int | None = None,
        head: float = HEAD,
    ) -> None:
        self.temperature = temperature
        self.min_p = min_p
        self.head = head
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: Logits) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        peak = float(logits.max())
        floor = peak - self.head * max(1.0, self.temperature)
        # (a wide head costs more gathered than weighed whole: told from every STRIDE-th token
        # first, as a pass over them all costs as much as weighing them)
        if np.count_nonzero(logits[::STRIDE] > floor) * WIDE <= len(logits) // STRIDE:
            ids = np.flatnonzero(logits > floor)
            if len(ids) * WIDE <= len(logits):
                drawn = self._draw(logits, peak, ids, floor)
                if drawn is not None:
                    return drawn
        drawn = self._draw(logits, peak, None, None)  # (every token counts)
        assert drawn is not None
        return drawn

    def _draw(
        self, logits: Logits, peak: float, ids: Ids | None, floor: float | None
    ) -> int | None:
        """A draw from the head ``ids``, the tokens above ``floor``, what the others weigh
        bounded (None, None: from every token); None when min_p reaches past the head."""
        tail = len(logits) - len(ids) if ids is not None else 0
        if self.min_p > 0:
            least = peak + math.log(self.min_p)
            if ids is None:
                ids = np.flatnonzero(logits >= least)
            elif tail and floor is not None and least <= floor:
                return None  # (min_p keeps tokens the head leaves out)
            else:
                ids = ids[logits[ids] >= least]
            tail = 0
        if ids is None:  # every token, none cut: weighed in place
            weights = np.subtract(logits, np.float32(peak), out=_scratch(len(logits)))
            if self.temperature != 1:
                weights *= np.float32(1 / self.temperature)
            return _pick(np.exp(weights, out=weights), self.rng.random())
        weights = self._weights(logits, ids, peak)
        if tail:  # the draw falls in the tail with its weight's share, settled when it may
            assert floor is not None
            head = float(weights.sum())
            bound = tail * math.exp(-self.head)  # (what the tail weighs at most, the peak's 1)
            u = self.rng.random()
            if u * (head + bound) >= head:
                rest = np.flatnonzero(logits <= floor)
                rest_weights = self._weights(logits, rest, peak)
                if u * (head + float(rest_weights.sum())) >= head:
                    ids, weights = rest, rest_weights
        return int(ids[_pick(weights, self.rng.random())])

    def _weights(self, logits: Logits, ids: Ids, peak: float) -> npt.NDArray[np.float64]:
        return np.exp((logits[ids].astype(np.float64) - peak) / self.temperature)


_SCRATCH: dict[int, npt.NDArray[np.float32]] = {}


def _scratch(size: int) -> npt.NDArray[np.float32]:
    """A buffer of ``size`` weights for a draw's work, the same at every draw (an array new
    at each draw would be memory mapped and faulted in afresh)."""
    buffer = _SCRATCH.get(size)
    if buffer is None:
        buffer = _SCRATCH[size] = np.empty(size, np.float32)
    return buffer


def _pick(weights: npt.NDArray[np.floating[Any]], u: float) -> int:
    """The index that a uniform ``u`` falls on, each index taking its weight's share: found
    in the running sums of blocks of BLOCK weights, then in its block's."""
    if len(weights) > BLOCK:
        whole = len(weights) // BLOCK * BLOCK
        sums = weights[:whole].reshape(-1, BLOCK).sum(axis=1)
        if whole < len(weights):
            sums = np.append(sums, weights[whole:].sum())
        cum = np.cumsum(sums, dtype=np.float64)
        target = u * cum[-1]
        block = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
        start = block * BLOCK
        inner = np.cumsum(weights[start : start + BLOCK], dtype=np.float64)
        before = cum[block - 1] if block else 0.0
        return start + min(
            int(np.searchsorted(inner, target - before, side="right")), len(inner) - 1
        )
    cum = np.cumsum(weights, dtype=np.float64)
    return min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(cum) - 1)
