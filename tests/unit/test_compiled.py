"""Which hot-path modules run compiled, and a build older than its source found out."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil
from pathlib import Path

from governor import compiled
from governor.compiled import MODULES, digest, record, source, status, summary


def test_every_listed_module_is_a_source_of_this_tree() -> None:
    for module in MODULES:
        assert source(module).is_file(), module
        assert importlib.util.find_spec(module) is not None


def tree(tmp_path: Path) -> Path:
    """A copy of the listed modules' sources, no build."""
    for module in MODULES:
        copy = source(module, tmp_path)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source(module), copy)
    return tmp_path


def build(root: Path, modules: tuple[str, ...]) -> None:
    """What deploy/compile.py leaves: an extension beside each source, and the record."""
    for module in modules:
        ext = importlib.machinery.EXTENSION_SUFFIXES[0]
        source(module, root).with_suffix(ext).write_bytes(b"")
    sources = {module: digest(source(module, root)) for module in modules}
    record(root).write_text(json.dumps(sources))


def test_no_build_is_pure_python(tmp_path: Path) -> None:
    root = tree(tmp_path)
    assert set(status(root).values()) == {"pure"}
    assert summary(root) == (True, "hot path in pure Python (deploy/compile.py compiles it)")


def test_a_build_of_the_sources_is_compiled(tmp_path: Path) -> None:
    root = tree(tmp_path)
    build(root, MODULES)
    assert set(status(root).values()) == {"compiled"}
    current, line = summary(root)
    assert current
    assert f"({len(MODULES)} of {len(MODULES)} modules)" in line


def test_a_source_changed_after_the_build_is_stale_and_said_so(tmp_path: Path) -> None:
    root = tree(tmp_path)
    build(root, MODULES)
    edited = "governor.listeners.session"
    with source(edited, root).open("a") as f:
        f.write("# an edit after the build\n")
    states = status(root)
    assert states[edited] == "stale"
    assert sum(s == "stale" for s in states.values()) == 1
    current, line = summary(root)
    assert not current
    assert edited in line
    assert "deploy/compile.py" in line


def test_an_extension_with_no_record_is_stale(tmp_path: Path) -> None:
    """(A build whose record was lost cannot be told current: it is not trusted.)"""
    root = tree(tmp_path)
    build(root, MODULES[:1])
    record(root).unlink()
    assert status(root)[MODULES[0]] == "stale"


def test_a_module_built_before_but_no_longer_listed_is_stale(tmp_path: Path) -> None:
    """(Its extension would still be imported before its source.)"""
    root = tree(tmp_path)
    build(root, MODULES)
    dropped = root / "protocol" / "dropped.py"
    dropped.write_text("")
    ext = importlib.machinery.EXTENSION_SUFFIXES[0]
    dropped.with_suffix(ext).write_bytes(b"")
    sources = json.loads(record(root).read_text()) | {"protocol.dropped": digest(dropped)}
    record(root).write_text(json.dumps(sources))
    assert status(root)["protocol.dropped"] == "stale"
    assert not summary(root)[0]


def test_this_tree_runs_what_its_status_says() -> None:
    """Whether this test run imported the compiled modules or their sources, the status read
    from the files agrees (and none is stale: the session would not have started)."""
    for module, state in status().items():
        origin = importlib.util.find_spec(module).origin  # type: ignore[union-attr]
        assert origin is not None
        assert origin.endswith(".py") == (state == "pure"), (module, state, origin)
    assert compiled.summary()[0]
