"""The one test clock: time that moves only when a test moves it, for the code that takes its
clock injected (the ledger, admission, the sessions, the fleet's gate, the listeners' timers)."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
