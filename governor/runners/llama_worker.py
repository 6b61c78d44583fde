"""A llama.cpp worker process: loads the model once, then runs one job at a time.

Started by :class:`governor.runners.llama.LlamaRunner` as ``python -m
governor.runners.llama_worker``. It speaks JSON lines: requests on stdin, events on stdout,
diagnostics on stderr. A crash here (a segfault in the native code, an out-of-memory kill) is
seen by the daemon as the end of stdout and costs only the job in hand.

    stdin:  {"op": "run", "id": str, "tokens": [int], "max_new_tokens": int,
             "temperature": float, "top_p": float, "seed": int | null, "stop": [str]}
            {"op": "cancel", "id": str}
    stdout: {"ev": "ready", "n_ctx": int}                       once, after loading and warming up
            {"ev": "token", "id": str, "text": str}             per token (text may be "")
            {"ev": "done", "id": str, "text": str, "completion_tokens": int,
             "finish_reason": "stop" | "length" | "cancelled"}  then the worker is free again

Cancellation is checked between tokens, so a job stops within one token of its cancel.
"""

from __future__ import annotations

import argparse
import codecs
import queue
import random
import sys
import threading
from typing import Any, BinaryIO

import orjson


def emit(out: BinaryIO, event: dict[str, Any]) -> None:
    out.write(orjson.dumps(event) + b"\n")
    out.flush()


class Generation:
    """One job's token loop: sampling, incremental detokenisation and stop strings."""

    def __init__(self, llm: Any, is_eog: Any, request: dict[str, Any]) -> None:
        self.llm = llm
        self.is_eog = is_eog
        self.request = request
        self.stops: list[str] = request["stop"]
        # Text that could still be the start of a stop string is held back until it cannot.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0  # characters of self.text already emitted

    def run(self, cancelled: threading.Event, out: BinaryIO) -> None:
        llm, req = self.llm, self.request
        seed = req["seed"] if req["seed"] is not None else random.randrange(2**31)
        llm.set_seed(seed)
        generated: list[int] = []
        finish = "length"
        for token in llm.generate(
            req["tokens"],
            temp=req["temperature"],
            top_p=req["top_p"],
            top_k=0 if req["temperature"] > 0 else 1,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        ):
            if cancelled.is_set():
                finish = "cancelled"
                break
            if self.is_eog(token):
                finish = "stop"
                break
            piece = llm.detokenize([token], prev_tokens=generated)
            generated.append(token)
            self.text += self.decoder.decode(piece)
            if self._stopped():
                finish = "stop"
                self._emit_token(out, final=True)
                break
            self._emit_token(out, final=False)
            if len(generated) >= req["max_new_tokens"]:
                break
        self.text += self.decoder.decode(b"", final=True)
        if finish != "stop":
            self._emit_token(out, final=True)
        emit(
            out,
            {
                "ev": "done",
                "id": req["id"],
                "text": self.text,
                "completion_tokens": len(generated),
                "finish_reason": finish,
            },
        )

    def _stopped(self) -> bool:
        """Cut the text at the first stop string, if one has appeared."""
        cuts = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]
            return True
        return False

    def _emit_token(self, out: BinaryIO, *, final: bool) -> None:
        upto = len(self.text) if final else max(len(self.text) - self.hold, self.sent)
        emit(out, {"ev": "token", "id": self.request["id"], "text": self.text[self.sent : upto]})
        self.sent = upto


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m governor.runners.llama_worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--n-ctx", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    args = parser.parse_args(argv)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but events may reach the daemon's pipe

    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=args.n_gpu_layers,
        verbose=False,
    )
    # The first evaluation after loading is slow (buffers are set up): pay it before "ready".
    for _ in llm.generate(llm.tokenize(b"Hello", add_bos=True), temp=0.0, top_k=1):
        break
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)

    def is_eog(token: int) -> bool:  # end of generation: EOS, EOT, <|im_end|> ...
        return bool(llama_cpp.llama_vocab_is_eog(vocab, token))

    emit(out, {"ev": "ready", "n_ctx": llm.n_ctx()})

    jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
    cancels: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def read_requests() -> None:
        for line in sys.stdin.buffer:
            request = orjson.loads(line)
            with lock:
                if request["op"] == "run":
                    cancels[request["id"]] = threading.Event()
                    jobs.put(request)
                # A job's run always comes first on the pipe: a cancel for an id not here is
                # for a job that has already finished.
                elif (flag := cancels.get(request["id"])) is not None:
                    flag.set()
        jobs.put(None)  # the daemon closed our stdin: exit

    threading.Thread(target=read_requests, daemon=True).start()
    while (request := jobs.get()) is not None:
        with lock:
            cancelled = cancels[request["id"]]
        try:
            Generation(llm, is_eog, request).run(cancelled, out)
        finally:
            with lock:
                del cancels[request["id"]]
    return 0


if __name__ == "__main__":
    sys.exit(main())
