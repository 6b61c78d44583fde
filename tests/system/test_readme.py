"""The README and the guides in docs/, run as written: each document's fenced blocks in order,
each as its marker says, in a session of its own (a reader follows one document at a time).

Every fenced block of these documents has a marker, an HTML comment on the line before it (a
reader never sees it):

* ``<!-- readme: run -->``: shell commands, run by bash from the repository's root, one after
  another. A line ending in ``&`` starts a background process (in a process group of its own)
  that lives until the next ``stop``; a line whose comment says ``exit N`` must exit N, every
  other line 0.
* ``<!-- readme: run background -->``: the same, as a reader leaves it running in a terminal
  of its own: the whole block is one background process.
* ``<!-- readme: output -->``: what the ``run`` block before it prints. Each line must appear,
  in order, among the lines printed (stdout and stderr, interleaved): ``…`` stands for any text, a number
  for any number.
* ``<!-- readme: python -->``: a Python program, run by ``.venv/bin/python``.
* ``<!-- readme: file NAME -->``: written to NAME, from the root (a config that later blocks
  use); removed at the end.
* ``<!-- readme: skip WHY -->``: not run (GPU and Kubernetes blocks, and the test command,
  which runs this test).

And, with no block, ``<!-- readme: stop -->`` (a line of its own, or the end of a line of text
that says to stop them): the background processes get SIGINT (Ctrl-C), must exit within a
minute, and a ``governor serve`` among them must exit 0.

So that a busy port never fails it, the test moves the README's ports (6379, 7777, 7778, 8000, 8080,
9464) to free ones, and gives ``governor serve`` its ``--listen``, ``governor-cli`` and the traffic
load tests their ``--addr`` where the README relies on the default. Nothing else is rewritten.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The documents whose commands a reader runs; the others (the protocol, the fleet, the
# benchmarks) quote commands and answers without markers.
DOCUMENTS = (
    "README.md",
    "docs/OPENAI.md",
    "docs/LOADTEST.md",
    "docs/OPERATIONS.md",
    "docs/CONFIG.md",
    "CONTRIBUTING.md",
)
README_MAX_LINES = 300
# The README's paths, one per kind of user, and the lines within which each shows a success.
PATHS = (
    "Two commands, and a first job",
    "Writing a TCP client",
    "Load tests",
    "As a sidecar",
    "Operating it",
)
PATHS_WITHIN = 150
PORTS = (6379, 7777, 7778, 8000, 8080, 9464)
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
MARKER = re.compile(r"^<!-- readme: (\w+)\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```")
STOP = "<!-- readme: stop -->"
KINDS = {"run", "output", "python", "file", "skip", "stop"}
BLOCK_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60


@dataclass
class Block:
    kind: str
    arg: str
    text: str
    line: int  # of the marker, in its document
    where: str = ""  # the document and that line, for messages


def blocks(text: str, name: str = "README.md") -> list[Block]:
    """The marked blocks of the document ``name`` in order; a fenced block without a marker
    fails the test."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if not marker and lines[i].rstrip().endswith(STOP):
            marker = MARKER.match(STOP)
        if marker:
            kind, arg = marker[1], marker[2]
            assert kind in KINDS, f"{name}:{i + 1}: unknown marker {kind!r}"
            if kind == "stop":
                found.append(Block(kind, arg, "", i + 1, f"{name}:{i + 1}"))
                i += 1
                continue
            fenced = i + 1 < len(lines) and FENCE.match(lines[i + 1])
            assert fenced, f"{name}:{i + 1}: a {kind} marker not right before a fenced block"
            end = next(j for j in range(i + 2, len(lines)) if FENCE.match(lines[j]))
            text = "\n".join(lines[i + 2 : end]) + "\n"
            found.append(Block(kind, arg, text, i + 1, f"{name}:{i + 1}"))
            i = end + 1
            continue
        assert not FENCE.match(lines[i]), (
            f"{name}:{i + 1}: a fenced block without a readme marker (see {__name__})"
        )
        i += 1
    return found


def free_ports() -> dict[int, int]:
    ports: dict[int, int] = {}
    sockets = []
    for port in PORTS:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports[port] = s.getsockname()[1]
    for s in sockets:
        s.close()
    return ports


def commands(text: str) -> Iterator[str]:
    """The block's commands: continued lines joined, a here-document kept whole with its
    command, blank and comment lines left out."""
    lines = iter(text.splitlines())
    pending = ""
    for raw in lines:
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if here := HEREDOC.search(line):
            end = here[1]
            body = list(itertools.takewhile(lambda ln: ln.strip() != end, lines))  # noqa: B023
            yield "\n".join([line, *body, end])
        elif line and not line.startswith("#"):
            yield line


def expected_exit(command: str) -> int:
    comment = command.partition(" #")[2]
    found = re.search(r"\bexit (\d+)", comment)
    return int(found[1]) if found else 0


@dataclass
class Session:
    """The README's shell, as a reader's terminal: ports moved, background processes kept."""

    ports: dict[int, int]
    logs: Path
    background: list[tuple[int, str, Path]] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)

    def rewrite(self, text: str) -> str:
        for port, free in self.ports.items():
            text = re.sub(rf"(?<!\d){port}(?!\d)", str(free), text)
        return text

    def defaults(self, command: str) -> str:
        """The default addresses the README relies on, made explicit."""
        addr = f"127.0.0.1:{self.ports[7777]}"
        if re.search(r"\bgovernor serve\b", command) and "--listen" not in command:
            command = re.sub(r"\bgovernor serve\b", f"governor serve --listen {addr}", command)
        if re.search(r"\bgovernor-cli\b", command) and "--addr" not in command:
            command = re.sub(r"\bgovernor-cli\b", f"governor-cli --addr {addr}", command)
        load = re.search(r"-m loadtest (burst|rate|mix|replay|idle)\b", command)
        if load and "--addr" not in command and "--openai" not in command:
            command = command.replace(load[0], f"{load[0]} --addr {addr}", 1)
        return command

    def script(self, block: Block) -> str:
        lines = [
            "set -m -eo pipefail",  # (-m: each background process in a group of its own)
            """trap 'echo "README-TEST: failed: $BASH_COMMAND" >&2' ERR""",
            f"cd {ROOT}",
        ]
        steps = [self.defaults(c) for c in commands(self.rewrite(block.text))]
        if block.arg == "background":
            steps = [" && ".join(c.partition(" #")[0].rstrip() for c in steps) + " &"]
        for n, command in enumerate(steps):
            first, newline, rest = command.partition("\n")
            code = first.partition(" #")[0].rstrip() + newline + rest
            if code.endswith("&"):
                name = f"{block.where}+{n}"
                log, rc = (
                    self.logs / f"bg{block.line}-{n}.log",
                    self.logs / f"bg{block.line}-{n}.rc",
                )
                lines.append(f"( set +e; {code[:-1]}; echo $? > {rc} ) > {log} 2>&1 &")
                lines.append(f'echo "$! {log} {name}" >> {self.logs / "pids"}')
            elif want := expected_exit(first):
                lines.append(f"if {code}; then rc=0; else rc=$?; fi")
                lines.append(
                    f'if [ $rc -ne {want} ]; then echo "README-TEST: command {n + 1} of the block '
                    f'exited $rc, expected {want}" >&2; exit 97; fi'
                )
            else:
                lines.append(code)
        return "\n".join(lines) + "\n"

    def run(self, block: Block, argv: list[str]) -> str:
        started = time.monotonic()
        proc = subprocess.run(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # interleaved, as a terminal shows them
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._note_background()
        out = proc.stdout
        assert proc.returncode == 0, (
            f"{block.where}: the block failed (exit {proc.returncode}, "
            f"{time.monotonic() - started:.1f} s):\n{out[-4000:]}\n{self.background_logs()}"
        )
        return out

    def _note_background(self) -> None:
        pids = self.logs / "pids"
        if not pids.exists():
            return
        for line in pids.read_text().splitlines():
            pid, log, name = line.split(" ", 2)
            self.background.append((int(pid), name, Path(log)))
        pids.unlink()

    def background_logs(self) -> str:
        return "\n".join(
            f"--- {where}:\n{log.read_text(errors='replace')[-2000:]}"
            for _, where, log in self.background
            if log.exists()
        )

    def stop(self) -> list[str]:
        """SIGINT to every background process group; the problems found."""
        problems = []
        for pid, _, _ in self.background:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for pid, where, log in self.background:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                problems.append(f"{where} still running {STOP_TIMEOUT_S} s after SIGINT")
                os.killpg(pid, signal.SIGKILL)
                continue
            rc_file = log.with_suffix(".rc")
            text = log.read_text(errors="replace")
            if "governor serve" in text or "governor listening" in text:
                rc = rc_file.read_text().strip() if rc_file.exists() else "unknown"
                if rc != "0":
                    problems.append(f"{where}: governor exited {rc}:\n{text[-2000:]}")
        self.background.clear()
        return problems


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def matches(expected: str, printed: str) -> str | None:
    """Why ``printed`` does not show ``expected`` (see the module docstring), or None."""
    lines = printed.splitlines()
    at = 0
    for want in expected.splitlines():
        if not want.strip():
            continue
        parts = re.split(r"(…|\d+(?:\.\d+)?)", want.strip())
        pattern = "".join(
            ".*" if p == "…" else r"\d+(?:\.\d+)?" if p and p[0].isdigit() else re.escape(p)
            for p in parts
        )
        regex = re.compile(pattern)
        while at < len(lines) and not regex.search(lines[at]):
            at += 1
        if at == len(lines):
            return f"no line like {want!r} (after the lines before it)"
        at += 1
    return None


def test_the_readme_fits_a_screen_of_paths() -> None:
    """At most README_MAX_LINES lines: what it is, the two commands and a path per kind of
    user; reference lives in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference to docs/"


def test_each_path_of_the_readme_succeeds_on_its_first_screens() -> None:
    """Each kind of user finds a command's output (a success, which the run test checks)
    within the README's first PATHS_WITHIN lines."""
    lines = (ROOT / "README.md").read_text().splitlines()
    for path in PATHS:
        start = lines.index(f"## {path}")
        first = next(i for i in range(start, len(lines)) if lines[i] == "<!-- readme: output -->")
        assert first < PATHS_WITHIN, f"{path!r}: its first output is at line {first + 1}"


@pytest.mark.parametrize("name", DOCUMENTS)
def test_the_document_runs_as_written(name: str, tmp_path: Path) -> None:
    session = Session(free_ports(), tmp_path)
    last = ""
    problems: list[str] = []
    try:
        for block in blocks((ROOT / name).read_text(), name):
            if block.kind == "skip":
                assert block.arg, f"{block.where}: a skip says why"
            elif block.kind == "file":
                path = ROOT / block.arg
                path.write_text(session.rewrite(block.text))
                session.written.append(path)
            elif block.kind == "run":
                script = tmp_path / f"block{block.line}.sh"
                script.write_text(session.script(block))
                last = session.run(block, ["bash", str(script)])
            elif block.kind == "python":
                program = tmp_path / f"block{block.line}.py"
                program.write_text(session.rewrite(block.text))
                last = session.run(block, [str(ROOT / ".venv/bin/python"), str(program)])
            elif block.kind == "output":
                why = matches(session.rewrite(block.text), last)
                assert why is None, f"{block.where}: {why}; printed:\n{last[-4000:]}"
            elif block.kind == "stop":
                problems += session.stop()
                assert not problems, "\n".join(problems)
    finally:
        problems += session.stop()
        for path in session.written:
            path.unlink(missing_ok=True)
    assert not problems, "\n".join(problems)
