"""The llama.cpp runner: the daemon's side (:mod:`.runner`, with :mod:`.prompts`), the worker
process it starts (:mod:`.worker`, stepping :mod:`.batching`'s plan, timed by :mod:`.stepcost`,
sampling with :mod:`.sampling` and :mod:`.structured`), and what the two say (:mod:`.messages`).
"""
