"""The pure decisions: what may run now, and what to answer when it may not.

Each module here decides from its inputs and an injected clock; none does IO, imports asyncio
or knows a listener (``tests/unit/test_layout.py`` holds them to it). The admission
(:mod:`.admission`) composes the others: the slot ledger (:mod:`.ledger`), which composes the
promise line (:mod:`.promises`), the retry hints (:mod:`.hints`), the service-time estimates
(:mod:`.estimates`) and the lanes' quotas and reserve (:mod:`.lanegate`); the lanes' costs
(:mod:`.policy`), tenants' quotas (:mod:`.tenants`), the KV budget (:mod:`.kvbudget`),
overload states (:mod:`.overload`), breakers (:mod:`.breaker`), job sizes and their learnt
rates (:mod:`.service`), objectives (:mod:`.slo`), per-address pacing (:mod:`.sources`) and the
fleet's side of a replica (:mod:`.fleetgate`).
"""
