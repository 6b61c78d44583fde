"""The doors: each listener turns bytes into calls on the shared state and back.

:mod:`.tcp` and :mod:`.session` serve the newline-JSON wire protocol, :mod:`.http` and
:mod:`.openai_api` the OpenAI-compatible front door, :mod:`.admin` the operator's probes and
metrics; :mod:`.tls` makes their TLS contexts.
"""
