"""A worker process on the real embedded model, told to suspend and resume a job: the job's greedy
text is the one it says unsuspended, whether its cells were kept meanwhile or the cache needed
them and the job computed them again from its prompt and its tokens so far."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import IO, Any

import orjson
import pytest

from governor.runners.llama import embedded_model_path

from .test_llama import N_GPU_LAYERS

LONG = 48  # the suspended job's tokens


class WorkerPipe:
    """A worker process, spoken to over its pipes as the daemon does."""

    def __init__(self, cells: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "governor.runners.llama_worker",
                "--model",
                str(embedded_model_path()),
                "--cells",
                str(cells),
                "--slots",
                "2",
                "--n-ctx",
                str(cells),
                "--step-tokens",
                "256",
                "--threads",
                "1",
                "--n-gpu-layers",
                str(N_GPU_LAYERS),
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

    def send(self, request: dict[str, Any]) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(orjson.dumps(request) + b"\n")
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
            {
                "op": "run",
                "id": key,
                "tokens": tokens,
                "max_new_tokens": max_new_tokens,
                "priority": priority,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 0,
                "min_p": 0.0,
                "seed": 0,
                "stop": [],
                "ignore_eos": True,
            }
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
                assert "error" not in done, done
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


@pytest.mark.parametrize("worker", [1024, 256], ids=["cells-kept", "recomputed"], indirect=True)
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
    # job's cells, which are dropped (and computed again on resume).
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
