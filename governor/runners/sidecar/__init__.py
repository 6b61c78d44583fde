"""The http runner, a sidecar in front of an OpenAI-compatible server: the runner
(:mod:`.runner`), its client of the upstream (:mod:`.upstream`, reading its stream with
:mod:`.framing`), the prompts it sends (:mod:`.prompts`) and the continuation of a paused job
(:mod:`.continuation`).
"""
