"""Suspension on the real embedded model.

A worker process told to suspend and resume a job: the job's greedy text is the one it says
unsuspended, whether its cells were kept meanwhile or the cache needed them and the job
computed them again from its prompt and its tokens so far. Through the daemon: a chat that
finds every slot lent to heavy work takes one back at once, the lent job resumes when the chat
ends, and a client that leaves while its job is suspended frees everything."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from typing import IO, Any

import orjson
import pytest

from clients import NO_RETRY
from governor.runners.llama.messages import Request
from governor.runners.llama.runner import LlamaRunner, embedded_model_path
from governor.runners.llama.worker import greedy_request
from governor.server import Server
from protocol.spec import JobSpec
from tests.conftest import ServerFactory, wait_until

from .test_llama import N_GPU_LAYERS, client_for, greedy

pytestmark = pytest.mark.real_model

LONG = 48  # the suspended job's tokens


class WorkerPipe:
    """A worker process, spoken to over its pipes as the daemon does."""

    def __init__(
        self, cells: int, slots: int = 2, layout: str = "pool", extra: tuple[str, ...] = ()
    ) -> None:
        """``cells``: the pool's, and the longest job (in the ``slots`` layout, each slot's);
        ``extra``: further options of the worker's."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "governor.runners.llama.worker",
                "--model",
                str(embedded_model_path()),
                "--cells",
                str(cells),
                "--slots",
                str(slots),
                "--n-ctx",
                str(cells),
                "--step-tokens",
                "256",
                "--threads",
                "1",
                "--n-gpu-layers",
                str(N_GPU_LAYERS),
                "--kv-layout",
                layout,
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        ready = self.event()
        assert ready["ev"] == "ready", ready
        self.cells: int = ready["cells"]
        self.texts: dict[str, str] = {}
        self.tokens: dict[str, int] = {}
        self.kv = 0  # the cells the jobs hold, as the last step said

    def send(self, *requests: Request | dict[str, Any]) -> None:
        """Requests in one write (the worker reads them all before its next step)."""
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(b"".join(orjson.dumps(request) + b"\n" for request in requests))
        stdin.flush()

    def event(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the worker exited"
        event: dict[str, Any] = orjson.loads(line)
        return event

    def run(self, key: str, tokens: list[int], max_new_tokens: int, priority: int) -> None:
        self.texts[key] = ""
        self.send(
            dataclasses.replace(greedy_request(key, tokens, max_new_tokens), priority=priority)
        )

    def steps(self) -> Iterator[list[str]]:
        """Each step's event, as the keys of the jobs it finished (texts gathered)."""
        while True:
            event = self.event()
            if event["ev"] != "step":
                continue
            self.kv = event["kv"]
            for out in event["out"]:
                self.texts[out["id"]] += out["text"]
                self.tokens[out["id"]] = out["n"]
            for done in event["done"]:
                assert done["error"] is None, done
                assert done["choices"][0]["text"] == self.texts[done["id"]]
            yield [done["id"] for done in event["done"]]

    def until_done(self, key: str) -> str:
        for finished in self.steps():
            if key in finished:
                return self.texts[key]
        raise AssertionError("unreachable")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def worker(request: pytest.FixtureRequest) -> Iterator[WorkerPipe]:
    pipe = WorkerPipe(request.param)
    try:
        yield pipe
    finally:
        pipe.close()


PROMPT = [1, 504, 3458, 281, 253, 1164, 28, 260, 1849, 30, 2373]  # (any tokens of the model)


@pytest.mark.parametrize("worker", [1024, 256], ids=["cells-kept", "cells-stashed"], indirect=True)
def test_a_suspended_job_says_what_it_says_unsuspended(worker: WorkerPipe) -> None:
    worker.run("alone", PROMPT, LONG, 1)
    unsuspended = worker.until_done("alone")
    assert len(unsuspended) > LONG  # (a real text, one token at least a character)

    worker.run("heavy", PROMPT, LONG, 1)
    for _ in worker.steps():
        if worker.tokens.get("heavy", 0) >= LONG // 3:
            break
    worker.send({"op": "suspend", "id": "heavy"})
    # A chat meanwhile; in the small cache, its reservation leaves no room for the suspended
    # job's cells, which are dropped (copied out of the cache, and put back on resume).
    dropped = worker.cells < 512
    chat = worker.cells - 8 if dropped else 32  # (its prompt: with max_new_tokens, all cells)
    worker.run("chat", [PROMPT[0], *([281] * (chat - 1))], 8, 0)
    for _ in worker.steps():  # (the suspend is handled before the chat: in the order sent)
        if worker.texts["chat"]:
            break
    before = worker.tokens["heavy"]
    # The cells held: the chat's, and the suspended job's unless they were dropped.
    assert (worker.kv <= chat + 8) == dropped
    worker.until_done("chat")
    assert worker.tokens["heavy"] == before  # not stepped while suspended
    worker.send({"op": "resume", "id": "heavy"})
    assert worker.until_done("heavy") == unsuspended


def test_with_a_stream_a_slot_a_job_whose_slot_a_chat_took_goes_on_from_its_stashed_cells() -> None:
    """One slot, a stream of cells: the chat needs the suspended job's slot, so its cells are
    copied out of the cache (llama.cpp's sequence state) and put back when it resumes. It
    then feeds only the token it sampled last: its next token comes out of the first step
    after the resume (computing again its 290 tokens would take two steps of 256), and its
    text is what it says unsuspended."""
    pipe = WorkerPipe(512, slots=1, layout="slots")
    try:
        pipe.run("alone", PROMPT, 400, 1)
        unsuspended = pipe.until_done("alone")
        pipe.run("heavy", PROMPT, 400, 1)
        for _ in pipe.steps():
            if pipe.tokens.get("heavy", 0) >= 280:
                break
        pipe.send({"op": "suspend", "id": "heavy"})
        pipe.run("chat", [PROMPT[0], *([281] * 40)], 8, 0)
        pipe.until_done("chat")
        before = pipe.tokens["heavy"]
        pipe.send({"op": "resume", "id": "heavy"})
        next(pipe.steps())
        assert pipe.tokens["heavy"] == before + 1
        assert pipe.until_done("heavy") == unsuspended
    finally:
        pipe.close()


# Through the daemon: admission suspends a lent job for a chat ------------------------------


async def lent_server(make_server: ServerFactory) -> Server:
    """Two slots, one of them the interactive reserve, lent (preemption is on by default)."""
    return await make_server(
        runner="llama",
        lanes=True,
        max_inflight=2,
        interactive_reserve=1,
        n_ctx=512,
        threads=1,
        n_gpu_layers=N_GPU_LAYERS,
        probe_interval=600,
    )


def heavy(prompt: str) -> JobSpec:
    return greedy(prompt, max_new_tokens=160, ignore_eos=True, lane="heavy")


async def test_a_chat_takes_a_lent_slot_back_at_once_and_the_lent_job_resumes(
    make_server: ServerFactory,
) -> None:
    server = await lent_server(make_server)
    ledger = server.ledger
    async with await client_for(server) as a, await client_for(server) as b:
        first = asyncio.ensure_future(a.generate(heavy("Once upon a time")))
        await wait_until(lambda: ledger.taken == 1, timeout=30)
        lent = asyncio.ensure_future(b.generate(heavy("The history of Rome")))
        await wait_until(lambda: ledger.taken == 2, timeout=30)  # the reserve, lent
        async with await client_for(server) as c:
            chat = await c.generate(greedy("Hello", max_new_tokens=4), retry=NO_RETRY)
        assert chat.done, chat.reply  # admitted at once: no yield
        assert ledger.suspensions["heavy"] == 1
        assert ledger.resumes["heavy"] == 1  # (back as soon as the chat ended)
        assert not first.done() or not lent.done()  # (the chat did not wait for them)
        results = await asyncio.gather(first, lent)
    for result in results:
        assert result.done, result.reply
        assert result.reply.result is not None
        assert result.reply.result["completion_tokens"] == 160
    assert (ledger.taken, ledger.inflight, ledger.suspended, ledger.kv_reserved) == (0, 0, 0, 0)


@pytest.mark.parametrize("tpot_slo_ms", [1.0, 1000.0])
async def test_past_the_reserve_a_chat_takes_a_slot_from_a_begun_job_only_with_slack(
    make_server: ServerFactory, tpot_slo_ms: float
) -> None:
    """Both slots run heavy jobs whose tokens have begun (the execution says so at the first
    token): the first chat takes the lent reserve back; the second takes the other slot only
    where the job's TPOT objective leaves it slack for the chat (1,000 ms a token, the heavy
    lane's default, against the tens of ms this model takes), and is refused where it does not
    (1 ms)."""
    server = await lent_server(make_server)
    ledger = server.ledger
    running = ledger._running  # (the slots running, to see their first tokens come)

    def job(prompt: str) -> JobSpec:
        return greedy(
            prompt, max_new_tokens=160, ignore_eos=True, lane="heavy", tpot_slo_ms=tpot_slo_ms
        )

    async with await client_for(server) as a, await client_for(server) as b:
        first = asyncio.ensure_future(a.generate(job("Once upon a time")))
        await wait_until(lambda: ledger.taken == 1, timeout=30)
        lent = asyncio.ensure_future(b.generate(job("The history of Rome")))
        await wait_until(lambda: ledger.taken == 2, timeout=30)
        await wait_until(lambda: all(slot.begun for slot in running), timeout=30)
        async with await client_for(server) as c, await client_for(server) as d:
            chat = asyncio.ensure_future(
                c.generate(greedy("Hello", max_new_tokens=32, ignore_eos=True), retry=NO_RETRY)
            )
            await wait_until(lambda: ledger.suspended == 1, timeout=10)
            second = await d.generate(greedy("Hi", max_new_tokens=4), retry=NO_RETRY)
            slack = tpot_slo_ms > 100
            assert second.done == slack, second.reply
            if not slack:
                assert second.reply.need_code == "server_busy", second.reply
            assert ledger.suspensions["heavy"] == 1 + slack
            assert (await chat).done
        for result in await asyncio.gather(first, lent):
            assert result.done, result.reply
            assert result.reply.result is not None
            assert result.reply.result["completion_tokens"] == 160
    assert ledger.resumes["heavy"] == ledger.suspensions["heavy"]
    assert (ledger.taken, ledger.inflight, ledger.suspended, ledger.kv_reserved) == (0, 0, 0, 0)


async def test_a_client_that_leaves_while_its_job_is_suspended_frees_everything(
    make_server: ServerFactory,
) -> None:
    server = await lent_server(make_server)
    ledger, runner = server.ledger, server.runner
    assert isinstance(runner, LlamaRunner)
    async with await client_for(server) as a:
        first = asyncio.ensure_future(a.generate(heavy("Once upon a time")))
        await wait_until(lambda: ledger.taken == 1, timeout=30)
        b = await client_for(server)
        lent = asyncio.ensure_future(b.generate(heavy("The history of Rome")))
        await wait_until(lambda: ledger.taken == 2, timeout=30)
        async with await client_for(server) as c:
            chat = asyncio.ensure_future(
                c.generate(greedy("Hello", max_new_tokens=64, ignore_eos=True), retry=NO_RETRY)
            )
            await wait_until(lambda: ledger.suspended == 1, timeout=10)
            await b.close()  # the suspended job's client leaves
            await wait_until(lambda: ledger.inflight == 2, timeout=10)
            assert ledger.suspended == 0
            assert (await chat).done
        lent.cancel()
        assert (await first).done
    await wait_until(lambda: runner.kv_used() == 0, timeout=10)
    assert (ledger.taken, ledger.inflight, ledger.suspended, ledger.kv_reserved) == (0, 0, 0, 0)
    assert ledger.resumes["heavy"] == 0
