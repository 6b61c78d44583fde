"""Cost-aware lanes and the KV budget: what a job may take, decided before it takes it.

Pure code, no IO. :func:`LanePolicy.classify` prices a prepared job and gives it a lane (or an
``abort`` reason when it can never run); :class:`SlotLedger.admit` then applies the lane's
slot quota, the interactive reserve and the KV budget in the same synchronous decision as the
global cap.

    CostScore = prompt_weight * prompt_tokens + output_weight * max_new_tokens
                + tool_risk_weight * tool_risk

Output tokens weigh twice prompt tokens by default: on the embedded model, one thread of the
development machine prefills a prompt token in 19.2 ms and decodes an output token in 37.7 ms
(measured 2026-11-22, 498-token prompt, warmed up; docs/BENCHMARKS.md). A job whose score is
at most the interactive lane's ``max_cost`` is interactive, at most the heavy lane's heavy,
else background (the lane table: :class:`LaneSettings`, ``[lanes.*]`` in the config file). A client may ask for a lower lane than its cost gives, never a higher one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from protocol.codes import NeedCode


class Lane(StrEnum):
    INTERACTIVE = "interactive"
    HEAVY = "heavy"
    BACKGROUND = "background"


LANES = (Lane.INTERACTIVE, Lane.HEAVY, Lane.BACKGROUND)  # highest priority first
NO_LANE = "-"  # the lane label of a job that has none (no lane policy, or not classified)


@dataclass(frozen=True, slots=True)
class Demand:
    """What an admitted job holds besides its slot."""

    lane: Lane
    kv_tokens: int  # prompt + max_new_tokens: the KV cache it may fill


@dataclass(frozen=True, slots=True)
class Rejection:
    """A job that can never run under this policy: ``abort`` with this code."""

    need_code: NeedCode
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneSettings:
    """One lane's row of the lane table (``[lanes.<name>]`` in the config file)."""

    max_cost: float = math.inf  # the costliest job it takes (a costlier one goes lower)
    slots: int | None = None  # slots it may hold at once (None: up to the cap)
    max_new_tokens: int = 1024  # a job asking for more goes to a lower lane


DEFAULT_LANES: dict[Lane, LaneSettings] = {
    Lane.INTERACTIVE: LaneSettings(max_cost=1500.0, max_new_tokens=256),
    Lane.HEAVY: LaneSettings(max_cost=12000.0),
    Lane.BACKGROUND: LaneSettings(),
}


def lane_table(**rows: LaneSettings) -> dict[Lane, LaneSettings]:
    """The default lane table with ``rows`` in place of their lanes' (by name)."""
    return {lane: rows.get(lane.value, DEFAULT_LANES[lane]) for lane in LANES}


@dataclass(frozen=True, slots=True, kw_only=True)
class LanePolicy:
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    tool_risk_weight: float = 0.0
    lanes: dict[Lane, LaneSettings] = field(default_factory=lambda: dict(DEFAULT_LANES))
    interactive_reserve: int = 1  # slots only interactive jobs may take
    # Lent to the lower lanes once no interactive job has been seen for this long (0: never).
    reserve_lend_after_s: float = 0.0
    prompt_ceiling: int = 0  # the longest prompt in tokens; 0: no ceiling beyond the context
    kv_capacity: int = 0  # tokens of KV cache across all workers; 0: no KV budget
    kv_danger: float = 0.8  # non-interactive work is refused above this share of capacity
    kv_interactive_share: float = 0.2  # capacity kept for interactive work

    def cost(self, prompt_tokens: int, max_new_tokens: int, tool_risk: float = 0.0) -> float:
        return (
            self.prompt_weight * prompt_tokens
            + self.output_weight * max_new_tokens
            + self.tool_risk_weight * tool_risk
        )

    def classify(
        self,
        prompt_tokens: int,
        max_new_tokens: int,
        requested: Lane | None = None,
        tool_risk: float = 0.0,
    ) -> Demand | Rejection:
        """The lane a job runs in, or why it never can."""
        if self.prompt_ceiling and prompt_tokens > self.prompt_ceiling:
            return Rejection(
                NeedCode.PROMPT_OVER_CEILING,
                f"the prompt is {prompt_tokens} tokens; the ceiling is {self.prompt_ceiling}",
            )
        score = self.cost(prompt_tokens, max_new_tokens, tool_risk)
        lanes = self.lanes
        lane = next((lane for lane in LANES[:-1] if score <= lanes[lane].max_cost), LANES[-1])
        if requested is not None and LANES.index(requested) > LANES.index(lane):
            lane = requested  # lower is allowed; higher is not
        # A job asking for more output than its lane allows belongs to a lower lane.
        for candidate in LANES[LANES.index(lane) :]:
            if max_new_tokens <= lanes[candidate].max_new_tokens:
                lane = candidate
                break
        else:
            return Rejection(
                NeedCode.MAX_NEW_TOKENS_INVALID,
                f"max_new_tokens {max_new_tokens} is over every lane's cap",
            )
        kv = prompt_tokens + max_new_tokens
        if self.kv_capacity and kv > self.kv_capacity:
            return Rejection(
                NeedCode.KV_OVER_CAPACITY,
                f"the job needs {kv} tokens of KV cache; the capacity is {self.kv_capacity}",
            )
        return Demand(lane, kv)
