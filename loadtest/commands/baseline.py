"""``baseline``: the queueing peer the governor is compared with, on the same model.

llama-cpp-python's own OpenAI-compatible server (``python -m llama_cpp.server``), started with
``--interrupt_requests False`` so that it queues every request (its default cuts a running
stream short when the next request arrives): the faithful "accept everything" runner. It
listens on 127.0.0.1 only; load it with ``--openai URL`` on any traffic command. The server
is this command's child: stopped by its own PID on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from ..support.arguments import add_model, add_n_ctx, add_threads
from ..support.baseline_server import start
from ..support.options import positive_int
from ..support.processes import stop

NAME = "baseline"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="run the queueing baseline: llama-cpp-python's server", description=__doc__
    )
    parser.add_argument("--port", type=positive_int, default=8000, help="its port on 127.0.0.1")
    add_threads(parser, default=2, text="n_threads: give it the cores the governor's workers share")
    add_n_ctx(parser, text="its context size")
    add_model(parser)


def run(args: argparse.Namespace) -> int:
    from governor.runners.llama.runner import embedded_model_path

    model = args.model or embedded_model_path()
    try:
        proc, url = start(model, args.port, threads=args.threads, n_ctx=args.n_ctx, quiet=False)
    except RuntimeError as exc:
        print(f"loadtest baseline: {exc}", file=sys.stderr)
        return 1
    print(
        f"baseline: llama_cpp.server on {model.name} at {url} (pid {proc.pid}); Ctrl-C stops it",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        proc.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        stop(proc)
    return 0
