"""How long a job will hold its slot, from its own size: rates learnt online, one model a pool.

A job's size is known at admission (its prompt in tokens and its ``max_new_tokens``), so a
running job's end can be predicted from it rather than from an average over jobs whose sizes
differ tenfold. Each pool's :class:`ServiceModel` learns, from the jobs that finish on it:

    base_s      a fixed overhead per job (scheduling, a worker round trip, HTTP)
    prefill_s   seconds per prompt token, up to the first output token
    decode_s    seconds per output token after the first
    ratio       output tokens per token of ``max_new_tokens`` asked (jobs stop early)

and predicts a job of ``prompt`` tokens asking for ``max_new`` as::

    base_s + prompt * prefill_s + decode_s * max(ratio * max_new - 1, 0)

How each is learnt from a finished job (its size at admission, its time to first token
``ttft``, its output tokens ``out``, the seconds it held its slot ``held``):

* ``ttft = base_s + prompt * prefill_s``: a least-squares line through the jobs' (prompt,
  ttft) points, each weighted by ``FIT_DECAY`` ** (jobs finished since), so about the last
  twenty jobs count and the rates follow the machine as it warms or gets busy. The two are
  told apart only by prompts of different lengths: until they differ, a weak prior
  (``PRIOR_JOBS`` of a job's weight) holds the overhead at 0 and the line goes through the
  origin (the first job's ttft is all prefill). Neither may go below 0: a fit that would
  have one negative is refitted with it at 0.
* ``decode_s``: an exponentially weighted mean (``ALPHA``) of ``(held - ttft) / (out - 1)``
  over jobs of two tokens or more (taken as 0 until one has finished).
* ``ratio``: the exponentially weighted means (``ALPHA``) of ``out`` and of ``max_new``,
  divided. A token-weighted ratio rather than a mean of each job's: the long jobs it gets
  wrong are the ones that hold a slot longest.

A prediction is what the slot's waiters are told, so erring late idles the slot (they come
back after it freed) and erring early costs one more refusal; the expected output length
(``ratio * max_new``) rather than the worst case (``max_new``) is the smaller error.

Where the runner knows what its tokens cost (:attr:`ServiceModel.assumed`: the batched llama
runner's step costs, fitted online from its steps, give a prompt token's cost and a step's with
every slot generating), its rates are used, with no overhead, rather than the learnt ones: on a
batched runner a finished job's time to first token counts the prompts fed before its own, and
its decode the prompts fed beside it, so rates learnt from them say what the load was, not what
a token costs (the running jobs' ends count that load from the work left:
:mod:`governor.core.estimates`); and the first long jobs are predicted from their size, not
from a prior a tenth of their length. The ratio is learnt all the same (1 until a job has
finished: a job is expected to use its ``max_new_tokens``). Where the runner knows nothing
(the stub, the http runner), and for a job without a size (a raw payload on the stub runner),
the prediction is ``mean_s``: the exponentially weighted mean (``ALPHA``) of
every finished job's ``held``, seeded with the runner's own estimate: the pool's estimate from
before there was a model. A job that did not finish (a runner failure, a cancel, its client
gone, out of time) is not passed here, and teaches nothing: its time says nothing about the
time of a job that runs to its end. A job that reports no ttft teaches the mean and the ratio,
and (once the line is fitted) the decode rate, with the line's ttft for its prompt.

Everything is pure arithmetic in constant time per job; :meth:`ServiceModel.predict_s` runs
once per admitted job and per refusal of a sized job, :meth:`ServiceModel.observe` once per
finished job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..runners.base import Rates

ALPHA = 0.2  # the weight of the newest job in the means (the ledger's EWMA_ALPHA)
FIT_DECAY = 0.95  # the weight left to the older jobs in the ttft line, per job
PRIOR_JOBS = 0.001  # the weight, in jobs, of the prior that the per-job overhead is 0


@dataclass(frozen=True, slots=True)
class JobSize:
    """What admission knows of a job's work: its prompt in tokens, its ``max_new_tokens`` (over
    all its sequences), and its width: the sequences it runs at once (a request's ``n``), each a
    slot of the cap."""

    prompt_tokens: int
    max_new_tokens: int
    width: int = 1


class ServiceModel:
    """One pool's service times: see the module docstring for the algorithm."""

    __slots__ = (
        "_asked",
        "_out",
        "_sums",
        "assumed",
        "base_s",
        "decode_s",
        "mean_s",
        "observed",
        "prefill_s",
        "ratio",
    )

    def __init__(self, expected_service_s: float) -> None:
        self.mean_s = expected_service_s  # every finished job; sized ones until the rates are
        self.base_s = 0.0
        self.prefill_s: float | None = None  # None until a sized job with a ttft has finished
        self.decode_s: float | None = None  # None (taken as 0) until such a job of 2 tokens has
        self.ratio = 1.0
        self.observed = 0  # finished jobs seen
        # The ttft line's weighted sums: weight, prompt, ttft, prompt², prompt x ttft.
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)
        self._out = self._asked = 0.0  # weighted means of output tokens and of max_new_tokens
        # The runner's own rates, until they are learnt (None: it does not know them).
        self.assumed: Callable[[], Rates | None] = lambda: None

    def knows(self, size: JobSize | None) -> bool:
        """Whether :meth:`predict_s` tells this job apart from the mean (it has a size, and
        the rates have been learnt or the runner says them)."""
        return size is not None and self.prompt_rate() is not None

    def prompt_rate(self) -> float | None:
        """Seconds a prompt token: the runner's, else learnt (None: neither)."""
        rates = self.assumed()
        return rates.prompt_s if rates is not None else self.prefill_s

    def decode_rate(self) -> float | None:
        """Seconds a generated token after the first: the runner's, else learnt."""
        rates = self.assumed()
        return rates.decode_s if rates is not None else self.decode_s

    def overhead_s(self) -> float:
        """Seconds a job takes besides its tokens: learnt, none at the runner's rates."""
        return self.base_s if self.assumed() is None else 0.0

    def predict_s(
        self, size: JobSize | None, decode_s: float | None = None, prompt_s: float | None = None
    ) -> float:
        """The seconds a job of ``size`` is expected to hold its slot (``decode_s``,
        ``prompt_s``: rates known better, measured on the jobs it will run beside)."""
        prefill_s = prompt_s if prompt_s is not None else self.prompt_rate()
        if size is None or prefill_s is None:
            return self.mean_s
        after_first = self.ratio * size.max_new_tokens - 1.0
        decode_s = decode_s if decode_s is not None else self.decode_rate()
        return (
            self.overhead_s()
            + size.prompt_tokens * prefill_s
            + (decode_s * after_first if after_first > 0.0 and decode_s else 0.0)
        )

    def observe(
        self,
        size: JobSize | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        ttft_s: float | None,
        held_s: float,
    ) -> None:
        """A job that finished: its size at admission (None: a raw payload) and what it
        measured (``prompt_tokens`` as the runner counted them; None where it did not say).

        The line is fitted on the size's prompt, the count the predictions will be made
        from: where admission only estimates it (the http runner, the stub), the estimate's
        bias is learnt into the rate. ``prompt_tokens`` is used for a job admitted without a
        size only, which the model does not tell apart anyway (so, today: never).
        """
        del prompt_tokens  # (see above)
        held_s = max(held_s, 0.0)
        self.observed += 1
        self.mean_s += ALPHA * (held_s - self.mean_s)
        if size is None or completion_tokens is None:
            return
        asked = size.max_new_tokens
        out = max(min(completion_tokens, asked), 0)
        # Both means start at 0, so their ratio needs no special first step.
        self._out += ALPHA * (out - self._out)
        self._asked += ALPHA * (asked - self._asked)
        if self._asked > 0.0:
            self.ratio = min(self._out / self._asked, 1.0)
        prompt = max(size.prompt_tokens, 0)
        if ttft_s is not None:
            ttft_s = min(max(ttft_s, 0.0), held_s)
            self._fit(prompt, ttft_s)
        elif self.prefill_s is not None:  # no first token seen: the line's ttft for its prompt
            ttft_s = min(self.base_s + prompt * self.prefill_s, held_s)
        else:
            return
        if out >= 2:
            decode = (held_s - ttft_s) / (out - 1)
            last = self.decode_s
            self.decode_s = decode if last is None else last + ALPHA * (decode - last)

    def _fit(self, x: float, y: float) -> None:
        """Add the point (prompt, ttft) to the line's sums and solve for base_s, prefill_s."""
        d = FIT_DECAY
        sw, sx, sy, sxx, sxy = self._sums
        sw, sx, sy, sxx, sxy = (
            d * sw + 1.0,
            d * sx + x,
            d * sy + y,
            d * sxx + x * x,
            d * sxy + x * y,
        )
        self._sums = sw, sx, sy, sxx, sxy
        sw += PRIOR_JOBS
        if sxx <= 0.0:  # every prompt empty: all of it is overhead
            self.base_s, self.prefill_s = sy / sw, 0.0
            return
        det = sw * sxx - sx * sx  # > 0: at least PRIOR_JOBS * sxx (Cauchy-Schwarz)
        base = (sy * sxx - sx * sxy) / det
        rate = (sw * sxy - sx * sy) / det
        if base < 0.0:
            base, rate = 0.0, sxy / sxx
        elif rate < 0.0:
            base, rate = sy / sw, 0.0
        self.base_s, self.prefill_s = base, rate
