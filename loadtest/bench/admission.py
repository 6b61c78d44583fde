"""``admission``: how long the admission decision itself takes, in process, with no network.

It times :meth:`governor.core.ledger.SlotLedger.admit` on its two paths: a slot taken (and released
again), and a refusal on a saturated ledger with ``--waiting`` refused clients already holding
promises (the hint is computed on this path; each refusal adds one more waiting client, up to
the ledger's bound). The network and the codec are not included: the
``burst`` command measures the whole exchange.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from governor.core.ledger import Completed, Refusal, Slot, SlotLedger

from ..support.options import positive_int, print_json

NAME = "admission"


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(NAME, help="time the admission decision (no network)")
    parser.add_argument("--cap", type=positive_int, default=4, help="max_inflight")
    parser.add_argument(
        "--waiting",
        type=int,
        default=1000,
        help="refused clients already waiting with a promise",
    )
    parser.add_argument(
        "--iterations", type=positive_int, default=200_000, help="decisions timed per path"
    )


def _per_call_us(fn: Any, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations * 1e6


def measure(cap: int, waiting: int, iterations: int) -> dict[str, Any]:
    free = SlotLedger(cap)

    def admit_and_release() -> None:
        slot = free.admit()
        assert isinstance(slot, Slot)
        slot.release(done=Completed())

    full = SlotLedger(cap, expected_service_s=3600.0)  # nothing lapses while we measure
    for _ in range(cap):
        full.admit()
    for _ in range(waiting):
        full.admit()

    def refuse() -> None:
        assert isinstance(full.admit(), Refusal)

    return {
        "command": NAME,
        "cap": cap,
        "waiting": waiting,
        "iterations": iterations,
        "admit_release_us": round(_per_call_us(admit_and_release, iterations), 3),
        "refuse_us": round(_per_call_us(refuse, iterations), 3),
    }


def run(args: argparse.Namespace) -> int:
    report = measure(args.cap, args.waiting, args.iterations)
    print(f"admit + release   {report['admit_release_us']:.2f} us per decision (cap {args.cap})")
    print(
        f"refuse with hint  {report['refuse_us']:.2f} us per decision "
        f"({args.waiting} clients already waiting)"
    )
    print_json(args, report)
    return 0
