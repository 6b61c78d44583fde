"""The doors: each listener turns bytes into calls on the shared state and back.

:mod:`.tcp` and :mod:`.session` (with its job table, :mod:`.jobs`, and replies, :mod:`.wire`)
serve the newline-JSON wire protocol, :mod:`.http` and :mod:`.openai_api` the OpenAI-compatible
front door, :mod:`.admin` the operator's probes and metrics; :mod:`.tls` makes their TLS
contexts. The two job doors authenticate and submit through one intake
(:mod:`governor.intake`) and only map its answers to their wire.
"""
