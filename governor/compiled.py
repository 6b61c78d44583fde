"""The hot path compiled: which modules ``deploy/compile.py`` builds with mypyc, and whether the
process runs them compiled.

mypyc turns a typed module into a C extension that Python imports instead of the ``.py`` file
beside it (an extension comes first in the import order). Only modules every job passes
through are listed: the codec, the upload, the TCP listener's connection class and its one
timer, the session and its job table, the intake, the execution, the admission with its ledger,
breaker, sources, service estimates, preemption and count of unserved jobs, and the sidecar's
decoders of its upstream's stream. (Not the job spec's parser nor the tenants' table: their
dataclasses take what a client or a config file gave, checked after, and a compiled
dataclass's own type check would answer a wrong type before the check's clear error.) Everything
works without them: with no C compiler, or after ``deploy/compile.py --clean``, the same modules
run as Python.

A compiled class keeps its attributes in C slots only when every base is compiled too: the
connection class is an :class:`asyncio.Protocol` by its methods, not by inheritance. And a
constant read from the class (``Deadlines``' grain, say) lives in the module: mypyc makes a class
attribute an instance attribute with a default, which the class itself does not hold.

The values the hot path makes several of a job (frames, upload parts, refusals, decisions,
prepared jobs) are dataclasses that are not frozen, though nothing changes one once made: a
frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, three to five
times slower, compiled or not (a 4-field one: 554 ns compiled against 188 not frozen).

A compiled module is *stale* when its ``.py`` changed after the build (``deploy/compile.py``
records each source's SHA-256 in :func:`record`): the process would run the old code, so the
daemon says so at start and the tests refuse to run.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
from pathlib import Path

MODULES = (
    "protocol.codes",
    "protocol.frames",
    "protocol.lines",
    "protocol.upload",
    "governor.core.admission",
    "governor.core.breaker",
    "governor.core.estimates",
    "governor.core.hints",
    "governor.core.lanegate",
    "governor.core.ledger",
    "governor.core.preemption",
    "governor.core.promises",
    "governor.core.service",
    "governor.core.sources",
    "governor.core.unserved",
    "governor.execution",
    "governor.intake",
    "governor.listeners.base",
    "governor.listeners.jobs",
    "governor.listeners.outbound",
    "governor.listeners.session",
    "governor.listeners.tcp",
    "governor.listeners.wire",
    "governor.runners.sidecar.framing",
    "governor.state",
)
ROOT = Path(__file__).resolve().parent.parent


def record(root: Path = ROOT) -> Path:
    """The build's record: each module's SHA-256 of the source it was built from."""
    return root / "governor" / "_hot.json"


def source(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extension(module: str, root: Path = ROOT) -> Path | None:
    """The module's extension for this interpreter, which an import takes before its ``.py``."""
    path = source(module, root)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (built := path.with_suffix(suffix)).exists():
            return built
    return None


def status(root: Path = ROOT) -> dict[str, str]:
    """Each module's state: ``compiled``, ``pure`` or ``stale`` (read from the files, whatever
    this process has imported)."""
    try:
        built: dict[str, str] = json.loads(record(root).read_text())
    except (OSError, ValueError):
        built = {}
    states = {}
    # (a module of an earlier build that the list no longer names runs compiled too: stale)
    for module in (*MODULES, *(m for m in built if m not in MODULES)):
        if extension(module, root) is None:
            states[module] = "pure"
        elif module in MODULES and built.get(module) == digest(source(module, root)):
            states[module] = "compiled"
        else:
            states[module] = "stale"
    return states


def summary(root: Path = ROOT) -> tuple[bool, str]:
    """For the daemon's start: whether the hot path runs its source (no stale module), and how,
    in one line."""
    states = status(root)
    stale = sorted(m for m, s in states.items() if s == "stale")
    if stale:
        return False, (
            f"the compiled {', '.join(stale)} predate their source: the old code runs; "
            "rebuild with deploy/compile.py (or remove with deploy/compile.py --clean)"
        )
    compiled = sum(s == "compiled" for s in states.values())
    if not compiled:
        return True, "hot path in pure Python (deploy/compile.py compiles it)"
    return True, f"hot path compiled with mypyc ({compiled} of {len(MODULES)} modules)"
