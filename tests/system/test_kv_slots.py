"""The ``slots`` layout of the KV cache (``kv_layout``), on the real embedded model.

Each slot (and the health probe) has a stream of ``n_ctx`` cells of its own, llama-server's
layout: a job's tokens attend over its own cells only. A job says the same in either layout;
every slot holds a whole context at once; a job moved down into a freed slot goes on as it
would have; a prompt's beginning that another slot holds is copied in (a stream is copied
whole, then cut), not computed again; and a job's further choices, which have no ids of their
own in this layout, wait for free slots and all finish."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from governor.runners.llama.batching import Entry, Sequence
from governor.runners.llama.runner import embedded_model_path
from governor.runners.llama.worker import Model, arguments, greedy_request

from .test_suspension import PROMPT, WorkerPipe

pytestmark = pytest.mark.real_model

N_CTX = 512
COMMON = PROMPT * 6
LATER = [*COMMON, 2373, 30, 260]


@pytest.fixture
def slots() -> Iterator[WorkerPipe]:
    pipe = WorkerPipe(N_CTX, slots=2, layout="slots")
    try:
        yield pipe
    finally:
        pipe.close()


def finish(pipe: WorkerPipe, *keys: str) -> dict[str, dict[str, Any]]:
    """Each job's "done" entry, once all of ``keys`` are done."""
    done: dict[str, dict[str, Any]] = {}
    while not set(keys) <= done.keys():
        event = pipe.event()
        if event["ev"] == "step":
            for entry in event["done"]:
                assert entry["error"] is None, entry
                done[entry["id"]] = entry
    return done


def alone(layout: str, tokens: list[int], max_new_tokens: int) -> str:
    """The job's greedy text, run alone in a new worker."""
    pipe = WorkerPipe(N_CTX, slots=2, layout=layout)
    try:
        pipe.send(greedy_request("alone", tokens, max_new_tokens))
        return str(finish(pipe, "alone")["alone"]["choices"][0]["text"])
    finally:
        pipe.close()


def test_a_job_says_the_same_in_either_layout() -> None:
    assert alone("slots", PROMPT, 48) == alone("pool", PROMPT, 48)


def test_a_job_moved_down_into_a_freed_slot_says_what_it_says_alone() -> None:
    """The job in the lowest slot ends first and none comes for its slot: the topmost job
    moves down into it (its stream copied), and goes on as if it had not moved."""
    pipe = WorkerPipe(N_CTX, slots=3, layout="slots")
    try:
        backwards = list(reversed(PROMPT))
        pipe.send(
            greedy_request("short", backwards, 2),
            greedy_request("middle", backwards * 2, 48),
            greedy_request("top", PROMPT, 48),
        )
        done = finish(pipe, "short", "middle", "top")
    finally:
        pipe.close()
    assert done["top"]["choices"][0]["text"] == alone("slots", PROMPT, 48)


def test_every_slot_holds_a_whole_context_at_once(slots: WorkerPipe) -> None:
    assert slots.cells == 2 * N_CTX
    prompts = [PROMPT * 4, list(reversed(PROMPT)) * 4]
    slots.send(
        *(
            greedy_request(f"j{i}", prompt, N_CTX - len(prompt))  # every cell of its slot
            for i, prompt in enumerate(prompts)
        )
    )
    done = finish(slots, "j0", "j1")
    assert [done[f"j{i}"]["completion_tokens"] for i in range(2)] == [
        N_CTX - len(prompt) for prompt in prompts
    ]


def later(first_suspended: bool) -> dict[str, Any]:
    """The "done" of a job whose prompt begins with that of "first", which is either
    suspended (holding its slot, so the beginning is copied in from it) or ended (so the job
    takes its slot and finds the beginning there). Either way, "later" is stepped alone."""
    pipe = WorkerPipe(N_CTX, slots=2, layout="slots")
    try:
        pipe.send(greedy_request("first", COMMON, 96))
        if first_suspended:
            while pipe.event().get("out") == []:  # (until "first" generates)
                pass
            pipe.send({"op": "suspend", "id": "first"}, greedy_request("later", LATER, 32))
        else:
            finish(pipe, "first")
            pipe.send(greedy_request("later", LATER, 32))
        return finish(pipe, "later")["later"]
    finally:
        pipe.close()


def test_a_beginning_held_by_another_slot_is_copied_in_not_computed() -> None:
    copied, kept = later(first_suspended=True), later(first_suspended=False)
    assert copied["cached_tokens"] == kept["cached_tokens"] == len(COMMON)
    assert copied["choices"] == kept["choices"]


def test_further_choices_wait_for_free_slots_and_all_finish() -> None:
    pipe = WorkerPipe(N_CTX, slots=1, layout="slots")  # two ids: the slot and the probe's
    try:
        pipe.send(dataclasses.replace(greedy_request("one", PROMPT, 16), n=1))
        one = finish(pipe, "one")["one"]["choices"][0]["text"]
        pipe.send(dataclasses.replace(greedy_request("three", PROMPT, 16), n=3))
        done = finish(pipe, "three")["three"]
    finally:
        pipe.close()
    assert [choice["text"] for choice in done["choices"]] == [one] * 3
    assert done["completion_tokens"] == 3 * 16


def test_a_preempted_step_leaves_none_of_its_tokens_in_the_cache() -> None:
    """Two prompts of different lengths in one step: with a stream a slot llama.cpp splits it
    into micro-batches (as many tokens of each stream, then the longer one's rest), and an
    aborted step gives back the positions of the micro-batch it aborted only. Aborted at its
    last operation, the step still leaves nothing in either stream: the worker plans it again,
    and a token left behind would put the next step's positions out of line (llama.cpp
    refuses such a step, and every job in it fails)."""
    import llama_cpp as ll
    from llama_cpp import _logger

    flags = f"--cells {N_CTX} --slots 2 --n-ctx {N_CTX} --step-tokens 256 --threads 1"
    flags += " --kv-layout slots"
    model = Model(arguments(["--model", str(embedded_model_path()), *flags.split()]))
    try:
        preempted(model, ll)
    finally:  # (the worker's log callback goes with its model: llama-cpp-python's, back)
        ll.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
        ll.llama_free(model.ctx)
        ll.llama_model_free(model.model)


def preempted(model: Model, ll: Any) -> None:
    """The step of the test above, run twice on ``model``: through, then aborted."""
    steps = [
        Sequence("a", tuple(PROMPT), 4, slot=0),
        Sequence("b", tuple(COMMON), 4, slot=1),
    ]
    entries = [Entry(seq, seq.prompt, 0, True) for seq in steps]
    calls = [0, 0]  # the callback's calls; the call that aborts (0: none)

    def abort(_: object) -> bool:
        calls[0] += 1
        return calls[0] == calls[1]

    model._abort = ll.ggml_abort_callback(abort)
    assert model.decode(entries, preemptible=True)[0] == 0
    held = [ll.llama_memory_seq_pos_max(model.memory, seq.slot) + 1 for seq in steps]
    assert held == [len(PROMPT), len(COMMON)]
    for seq in steps:
        model.forget(seq.slot, 0)
    calls[:] = [0, calls[0]]  # now abort at the last call: in the last micro-batch
    assert model.decode(entries, preemptible=True)[0] == 2
    assert [ll.llama_memory_seq_pos_max(model.memory, seq.slot) for seq in steps] == [-1, -1]
