"""llama.cpp's own server, ``llama-server``, as a side-by-side reference: where
``deploy/build-llama-server.sh`` keeps its binary, and the command line that starts it on a
loopback port with S slots (``-np S``). Each command that runs it starts it on a free port
(:func:`~.processes.free_port`), waits for :data:`READY_PATH` to answer 200 (it answers 503
while the model loads) and stops it by its own PID (:func:`~.processes.stop`)."""

from __future__ import annotations

import os
from pathlib import Path

READY_PATH = "/health"
BUILD_SCRIPT = "deploy/build-llama-server.sh"


def default_binary() -> Path:
    """Where deploy/build-llama-server.sh keeps its binary."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "governor" / "llama-server" / "llama-server"


def command(
    binary: Path,
    model: Path,
    *,
    port: int,
    slots: int,
    ctx: int,
    threads: int,
    n_gpu_layers: int = 0,
    unified_kv: bool = False,
) -> list[str]:
    """``llama-server -m MODEL -np SLOTS -c CTX -t THREADS`` on 127.0.0.1:``port``. ``-c`` is
    the context of all slots together: without ``unified_kv`` (``-kvu``, one KV cache the slots
    share) each slot gets ``ctx / slots`` tokens."""
    return [
        str(binary),
        "-m",
        str(model),
        "-np",
        str(slots),
        *(["-kvu"] if unified_kv else []),
        "-c",
        str(ctx),
        "-t",
        str(threads),
        "-ngl",
        str(n_gpu_layers),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
