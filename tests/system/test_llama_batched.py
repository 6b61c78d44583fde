"""The batched llama runner on the real embedded model: many sequences in one worker process.

What holds under batching, on the real model with greedy sampling: a stream's first tokens are
the same beside seven others as alone. Later ones may differ: llama.cpp computes a step of one
token and a step of many with different kernels, whose float results differ in the last bits,
and where two candidates are close greedy picks another (one of these eight streams says "Nova
Haven" beside the others and "New Haven" alone, at its fifth token, in some runs); a job's cells are reserved at
admission, so a job that would not fit yields ``kv_pressure`` and none fails in the runner;
a cancel frees its cells before the next step; a crash aborts every job of the worker; a prompt
prefix already in the cache is not computed again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

import pytest

from clients import NO_RETRY, GovernorClient
from governor.runners.llama.runner import LlamaRunner
from governor.runners.llama.worker import greedy_request
from governor.server import Server
from loadtest.support.processes import parent_pids
from protocol.spec import Message
from tests.conftest import ServerFactory, wait_until

from .test_llama import N_GPU_LAYERS, client_for, generating, greedy, worker_pids
from .test_suspension import WorkerPipe

pytestmark = pytest.mark.real_model

# The tokens a stream says beside others as alone: 4 on the CPU; on a GPU (an H100, measured)
# llama.cpp's kernels for one token and for a batch differ more, and the third token can differ.
FIRST_TOKENS = 4 if N_GPU_LAYERS == 0 else 1

PROMPT_TOKENS = [1, 504, 3458, 281, 253, 1164, 28, 260, 1849, 30, 2373]  # (words of the model)

PROMPTS = [
    "Once upon a time",
    "The history of Rome",
    "Write a poem about the sea",
    "In the beginning",
    "My favourite recipe is",
    "The ocean is",
    "Tell me about space",
    "A long time ago",
]


async def batched(make_server: ServerFactory, **config: Any) -> Server:
    config.setdefault("max_inflight", 8)
    config.setdefault("n_ctx", 512)
    # One thread: ggml's threads spin at a barrier at every step of the graph, so two of them on
    # a CPU shared with other busy processes can take seconds over one step.
    config.setdefault("threads", 1)
    config.setdefault("n_gpu_layers", N_GPU_LAYERS)
    return await make_server(runner="llama", **config)


async def texts(server: Server, prompts: list[str], max_new_tokens: int) -> list[str]:
    async def one(prompt: str) -> str:
        async with await client_for(server) as client:
            result = await client.generate(greedy(prompt, max_new_tokens=max_new_tokens))
        assert result.done, result.reply
        assert result.reply.result is not None
        return str(result.reply.result["text"])

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def test_a_stream_beside_seven_others_says_what_it_says_alone(
    make_server: ServerFactory,
) -> None:
    alone_server = await batched(make_server)
    alone = [(await texts(alone_server, [p], FIRST_TOKENS))[0] for p in PROMPTS]
    together = await texts(await batched(make_server), PROMPTS, 24)
    for first, whole in zip(alone, together, strict=True):
        assert whole.startswith(first)
    assert len(set(alone)) == len(PROMPTS)  # (eight different streams, not one eight times)


async def test_eight_streams_share_one_worker_process(make_server: ServerFactory) -> None:
    server = await batched(make_server)
    runner = server.runner
    assert isinstance(runner, LlamaRunner)
    assert len(worker_pids(runner)) == 1
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, server.ledger.inflight)
            await asyncio.sleep(0.005)

    watcher = asyncio.ensure_future(watch())
    try:
        await texts(server, PROMPTS, 32)
    finally:
        watcher.cancel()
    assert peak == 8  # all eight admitted at once: they ran together, not in turn
    assert len(worker_pids(runner)) == 1


async def test_a_crash_aborts_every_job_of_the_worker_and_it_is_replaced(
    make_server: ServerFactory,
) -> None:
    server = await batched(make_server, max_inflight=4)
    runner = server.runner
    assert isinstance(runner, LlamaRunner)
    (victim,) = worker_pids(runner)
    clients = [await client_for(server) for _ in range(3)]
    try:
        jobs = [await generating(c) for c in clients]
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*jobs), 15)
        assert [(r.reply.status, r.reply.need_code) for r in results] == [
            ("abort", "runner_crashed")
        ] * 3
        assert server.ledger.inflight == 0
        assert server.ledger.kv_reserved == 0
        await wait_until(lambda: len(worker_pids(runner)) == 1, timeout=60)
        assert worker_pids(runner) != [victim]
        after = await clients[0].generate(greedy("Hi", max_new_tokens=3))
        assert after.done
    finally:
        for c in clients:
            await c.close()


async def test_a_cancel_frees_its_cells_and_the_other_streams_go_on(
    make_server: ServerFactory,
) -> None:
    server = await batched(make_server, max_inflight=4)
    runner = server.runner
    assert isinstance(runner, LlamaRunner)
    async with await client_for(server) as a, await client_for(server) as b:
        stays = await generating(a, job="J_stays")
        goes = await generating(b, job="J_goes")
        await wait_until(lambda: runner.kv_used() > 100, timeout=30)
        both = runner.kv_used()
        await b.cancel("J_goes")
        result = await asyncio.wait_for(goes, 10)
        assert (result.reply.status, result.reply.need_code) == ("abort", "cancelled")
        # The cancelled stream's cells (half of them) are gone by the worker's next report,
        # while the other stream grows by a cell a step.
        await wait_until(lambda: runner.kv_used() < both, timeout=5)
        assert not stays.done()
        await a.cancel("J_stays")
        await asyncio.wait_for(stays, 10)
        await wait_until(lambda: runner.kv_used() == 0, timeout=5)


async def test_a_job_that_would_not_fit_the_cache_yields_kv_pressure(
    make_server: ServerFactory,
) -> None:
    # 600 cells for 4 slots; each job below reserves its 5 prompt tokens and 250 more.
    server = await batched(make_server, max_inflight=4, n_ctx=300, kv_capacity=600)
    async with await client_for(server) as a, await client_for(server) as b:
        spec = greedy("Once upon a time there", max_new_tokens=250, stream=True)
        started = asyncio.Event()
        jobs = [
            asyncio.ensure_future(a.generate(spec, on_delta=lambda _: started.set())),
            asyncio.ensure_future(b.generate(spec)),
        ]
        await asyncio.wait_for(started.wait(), 30)
        async with await client_for(server) as c:
            third = await c.generate(spec, retry=NO_RETRY)
        assert (third.reply.status, third.reply.need_code) == ("yield", "kv_pressure")
        assert third.reply.retry_hint_ms is not None
        reserved = server.ledger.kv_reserved
        results = await asyncio.gather(*jobs)
    assert all(r.done for r in results)  # the two admitted jobs ran to their end
    assert results[0].reply.result is not None
    assert reserved == 2 * (results[0].reply.result["prompt_tokens"] + 250)
    assert server.ledger.kv_reserved == 0


@pytest.mark.parametrize("layout", ["pool", "slots"])
async def test_a_shared_system_prompt_is_computed_once(
    make_server: ServerFactory, layout: str
) -> None:
    system = Message("system", "You are a terse assistant who answers in one short sentence. " * 3)

    def chat(question: str) -> Any:
        return greedy(messages=(system, Message("user", question)), max_new_tokens=12)

    fresh = await batched(make_server, kv_layout=layout)
    async with await client_for(fresh) as client:
        cold = await client.generate(chat("What is the capital of Italy?"))
    server = await batched(make_server, kv_layout=layout)
    async with await client_for(server) as client:
        first = await client.generate(chat("Name a colour."))
        warm = await client.generate(chat("What is the capital of Italy?"))
    assert cold.reply.result is not None
    assert first.reply.result is not None
    assert warm.reply.result is not None
    assert cold.reply.result["cached_tokens"] == 0
    # The template's opening and the system prompt (over 40 tokens) were in the cache.
    assert warm.reply.result["cached_tokens"] > 40
    assert warm.reply.result["text"] == cold.reply.result["text"]


async def test_two_workers_each_take_their_share(make_server: ServerFactory) -> None:
    server = await batched(make_server, max_inflight=4, workers=2, threads=1)
    runner = server.runner
    assert isinstance(runner, LlamaRunner)
    assert len(worker_pids(runner)) == 2
    assert [c.sequences for c in runner.kv_caches()] == [2, 2]
    # The default cache: two jobs of n_ctx in each (two slots each: nothing more).
    assert [c.cells for c in runner.kv_caches()] == [2 * 512, 2 * 512]
    caches = []
    original = runner.run

    def spy(job: Any) -> Any:
        caches.append(job.kv_cache)
        return original(job)

    runner.run = spy  # type: ignore[method-assign]
    outputs = await texts(server, PROMPTS[:4], 8)
    assert sorted(caches) == [0, 0, 1, 1]  # admission spread them over both caches
    assert all(outputs)


async def test_sampling_runs_llama_cpp_s_chain_with_the_spec_s_settings(
    make_server: ServerFactory,
) -> None:
    server = await batched(make_server)
    prompt = "The best thing about summer is"
    async with await client_for(server) as client:

        async def text(**fields: Any) -> str:
            result = await client.generate(greedy(prompt, max_new_tokens=16, **fields))
            assert result.reply.result is not None, result.reply
            return str(result.reply.result["text"])

        greedy_text = await text()
        # top_k 1 leaves one candidate: greedy, whatever the temperature and seed.
        assert await text(temperature=1.5, top_k=1, seed=1) == greedy_text
        assert await text(temperature=1.5, top_k=1, seed=2) == greedy_text
        # A seed repeats its draw; hot sampling over the whole vocabulary strays from greedy.
        hot = [await text(temperature=1.5, seed=s) for s in (1, 1, 2)]
        assert hot[0] == hot[1]
        assert greedy_text not in hot
        # min_p 1 keeps only tokens as likely as the likeliest: greedy again.
        assert await text(temperature=1.5, min_p=1.0, seed=3) == greedy_text


async def test_ignore_eos_generates_past_the_end_of_generation(make_server: ServerFactory) -> None:
    server = await batched(make_server)
    chat = greedy(messages=(Message("user", "Say hi."),), max_new_tokens=64)
    async with await client_for(server) as client:
        ends = await client.generate(chat)
        goes_on = await client.generate(dataclasses.replace(chat, ignore_eos=True))
    assert ends.reply.result is not None
    assert goes_on.reply.result is not None
    assert ends.reply.result["finish_reason"] == "stop"
    assert ends.reply.result["completion_tokens"] < 64
    assert (goes_on.reply.result["finish_reason"], goes_on.reply.result["completion_tokens"]) == (
        "length",
        64,
    )


async def test_a_chat_preempts_a_long_prompt_step_in_progress(make_server: ServerFactory) -> None:
    """One step holds the rewrite's whole prompt (batch_tokens 2048): the chat that arrives
    while it runs aborts it, so the chat's first token comes before the rewrite's. Without
    preemption the chat would wait for that step, at whose end the rewrite samples its first
    token."""
    if N_GPU_LAYERS:
        pytest.skip("llama.cpp's CUDA backend does not check the abort callback")
    # (No probes: on a loaded machine the one long step can outlast a probe's timeout.)
    server = await batched(
        make_server, lanes=True, batch_tokens=2048, n_ctx=2048, probe_interval=600
    )
    firsts: list[str] = []
    rewrite = greedy("The quick brown fox jumps over the lazy dog. " * 150, max_new_tokens=4)
    chat = greedy("Once upon a time", max_new_tokens=4)  # (no stop strings: no text held)
    async with await client_for(server) as a, await client_for(server) as b:
        heavy = asyncio.ensure_future(
            a.generate(
                dataclasses.replace(rewrite, lane="heavy", stream=True),
                on_delta=lambda _: firsts.append("rewrite"),
            )
        )
        await wait_until(lambda: server.ledger.inflight == 1, timeout=10)
        await asyncio.sleep(0.05)  # (the rewrite's step has begun)
        interactive = await b.generate(
            dataclasses.replace(chat, stream=True), on_delta=lambda _: firsts.append("chat")
        )
        await heavy
    assert interactive.done
    assert heavy.result().done  # preempted, then finished
    assert firsts[0] == "chat"


def worker_children() -> list[int]:
    """This process's child processes that are llama workers, from /proc."""
    pids = []
    for pid, parent in parent_pids().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                is_worker = b"governor.runners.llama.worker" in cmdline.read()
        except OSError:
            continue  # (gone meanwhile)
        if parent == os.getpid() and is_worker:
            pids.append(pid)
    return pids


async def test_closing_while_a_worker_restarts_leaves_no_process_behind(
    make_server: ServerFactory,
) -> None:
    """A restart cancelled by the close (the new process still loading) stops that process
    too: no one else knows of it, and a child left running would hold up the event loop's
    close."""
    server = await batched(make_server, max_inflight=2)
    runner = server.runner
    assert isinstance(runner, LlamaRunner)
    (victim,) = worker_pids(runner)
    os.kill(victim, signal.SIGKILL)
    await wait_until(lambda: [p for p in worker_children() if p != victim] != [], timeout=30)
    assert runner._restarting == 1  # the new worker is loading
    await server.close()
    await wait_until(lambda: not [p for p in worker_children() if p != victim], timeout=10)


async def test_chats_keep_their_pace_beside_long_rewrites(make_server: ServerFactory) -> None:
    """Eight slots, lanes on: six chats alone, then the same six beside two rewrites whose long
    prompts are being fed. Each chat's time per output token beside them stays within a loose
    multiple of the chats' alone (the step budget holds it near 1.5: prompt chunks are cut to
    the chats' stall; without it, a chunk of batch_tokens, about a second here, every token)."""
    server = await batched(make_server, lanes=True, n_ctx=2048, probe_interval=600)
    questions = [f"In one sentence, what is {topic}?" for topic in PROMPTS]

    async def chat(client: GovernorClient, k: int) -> float:
        spec = greedy(messages=(Message("user", questions[k % 8]),), max_new_tokens=16)
        result = await client.generate(dataclasses.replace(spec, ignore_eos=True))
        assert result.done, result.reply
        assert result.reply.result is not None
        return float(result.reply.result["tpot_ms"])

    async def chats(first: int) -> list[float]:
        clients = [await client_for(server) for _ in range(6)]
        try:
            return list(await asyncio.gather(*(chat(c, first + i) for i, c in enumerate(clients))))
        finally:
            for c in clients:
                await c.close()

    alone = await chats(0)
    words = "The harbour committee met on the first Tuesday of the month. " * 60  # ~800 tokens
    rewrite = greedy(words, max_new_tokens=4, lane="heavy")
    async with await client_for(server) as a, await client_for(server) as b:
        heavy = [
            asyncio.ensure_future(c.generate(dataclasses.replace(rewrite, prompt=f"{i} {words}")))
            for i, c in enumerate((a, b))
        ]
        await wait_until(lambda: server.ledger.inflight == 2, timeout=10)
        beside = await chats(2)
        assert [(await h).done for h in heavy] == [True, True]
    assert max(beside) <= 4 * max(alone), (alone, beside)


def test_short_prompts_that_arrive_together_are_fed_in_one_step() -> None:
    """Four chats' prompts reach the worker together while a job generates (a real worker
    process, driven as the daemon drives it): one step feeds all four (their first tokens come
    out of the same step event), beside the running job's token; a scheduler that fed one
    prompt a step would spread them over four steps."""
    pipe = WorkerPipe(2048, slots=5)
    try:
        pipe.run("running", list(range(1000, 1200)), 64, priority=0)
        steps = pipe.steps()
        next(steps)  # its prompt, fed while nothing else is here
        chat: dict[str, Any] = {"priority": 0, "tpot_ms": 100.0, "ttft_ms": 1000.0, "gap_ms": 500.0}
        keys = [f"chat{i}" for i in range(4)]
        for key in keys:
            pipe.texts[key] = ""
        pipe.send(
            *(
                dataclasses.replace(
                    greedy_request(key, list(range(2000 + 50 * i, 2030 + 50 * i)), 4), **chat
                )
                for i, key in enumerate(keys)
            )
        )
        first: dict[str, int] = {}  # the step each chat's first token came out of
        for number, _ in enumerate(steps):
            for key in keys:
                if key in pipe.tokens:
                    first.setdefault(key, number)
            if len(first) == len(keys):
                break
        assert len(set(first.values())) == 1, first
        assert pipe.tokens["running"] < 64  # (it was generating all along)
    finally:
        pipe.close()


@pytest.mark.parametrize(
    ("waiting", "offered"),
    [(True, False), (True, True), (False, False)],
    ids=["jobs-wait", "offered-to-none", "none-waits"],
)
def test_a_job_given_a_freed_slot_while_jobs_wait_starts_at_the_next_step(
    waiting: bool, offered: bool
) -> None:
    """While the daemon says jobs wait for a slot, the step after a job's last token waits for
    the run of the job given the freed slot (here 0.3 s late: a slow daemon; the worker waits
    up to 5 s), so its prompt goes into that very step beside the running stream. It goes on
    at once when the daemon says it offered the slot and none took it ("offered" first: the
    run that follows 0.3 s later misses the step), or when no job waits."""
    pipe = WorkerPipe(1024, slots=2, extra=("--refill-ms", "5000"))
    try:
        if waiting:
            pipe.send({"op": "waiting", "jobs": True})
        pipe.run("long", PROMPT_TOKENS, 64, priority=0)
        pipe.run("short", PROMPT_TOKENS[:6], 3, priority=0)
        for finished in pipe.steps():
            if "short" in finished:
                break
        made = pipe.tokens["long"]
        if offered:
            time.sleep(0.3)
            pipe.send({"op": "offered", "id": "short"})
        time.sleep(0.3)
        pipe.run("next", PROMPT_TOKENS[2:], 4, priority=0)
        next(pipe.steps())
        assert pipe.tokens["long"] == made + 1  # (a step of the running stream)
        assert ("next" in pipe.tokens) == (waiting and not offered), pipe.tokens
    finally:
        pipe.close()


def test_the_health_probe_is_stepped_alone_and_changes_no_greedy_text() -> None:
    """llama.cpp's numerics depend on a step's batch, so a probe sharing a job's steps could
    turn a greedy near-tie (a README chat at temperature 0 once went on for 128 tokens instead
    of stopping, when a probe came by). Probes sent while a job generates each take a step of
    their own (the job makes no token in the step that gives the probe its token), and the job
    says what it says without them (each run in a fresh worker: no cells reused)."""
    prompt = list(range(1000, 1040))
    probe = dataclasses.replace(
        greedy_request("probe", list(range(3000, 3006)), 1), priority=9, alone=True
    )
    pipe = WorkerPipe(1024, slots=2)
    try:
        pipe.run("job", prompt, 48, priority=0)
        probed = 0
        tokens = 0  # the job's, as of the step before
        for finished in pipe.steps():
            if "probe" in finished:
                assert pipe.tokens["job"] == tokens, "the probe shared the job's step"
                probed += 1
            if "job" in finished:
                break
            tokens = pipe.tokens.get("job", 0)
            if "probe" in finished or (tokens == 1 and not probed):
                pipe.texts["probe"] = ""
                pipe.send(probe)
        beside = pipe.texts["job"]
    finally:
        pipe.close()
    assert probed >= 3
    pipe = WorkerPipe(1024, slots=2)
    try:
        pipe.run("job", prompt, 48, priority=0)
        assert pipe.until_done("job") == beside
    finally:
        pipe.close()
