"""The pure decisions: what may run now, and what to answer when it may not.

Each module here decides from its inputs and an injected clock; none does IO, imports asyncio
or knows a listener (``tests/test_layout.py`` holds them to it). The admission
(:mod:`.admission`) composes the others: the slot ledger and its promise line (:mod:`.ledger`),
the lanes (:mod:`.policy`), tenants' quotas (:mod:`.tenants`), the KV budget (:mod:`.kvbudget`),
overload states (:mod:`.overload`), breakers (:mod:`.breaker`), service-time estimates
(:mod:`.service`), objectives (:mod:`.slo`), per-address pacing (:mod:`.sources`) and the
fleet's side of a replica (:mod:`.fleetgate`).
"""
