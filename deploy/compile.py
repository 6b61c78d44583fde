"""Compile the hot path's modules (:data:`governor.compiled.MODULES`) with mypyc, in place.

    .venv/bin/python deploy/compile.py           build (nothing to do when up to date)
    .venv/bin/python deploy/compile.py --clean   remove the build: the modules run as Python

``deploy/setup.sh`` runs it with the C compiler the llama.cpp build needs already, and falls back
to pure Python when it fails. The modules are compiled together (calls between them are direct C
calls), into one shared library, ``governor/_hot__mypyc*.so``, with a small extension beside each
module's ``.py``. ``governor/_hot.json`` records the sources built; :mod:`governor.compiled`
tells a stale build from a current one. The intermediate C goes to ``build/mypyc``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from governor.compiled import MODULES, digest, extension, record, source, status  # noqa: E402

GROUP = "governor._hot"  # the shared library's name: governor/_hot__mypyc.*.so


def built_files() -> list[Path]:
    modules = set(MODULES) | set(status())  # (with those of an earlier build's list)
    files = [path for module in modules if (path := extension(module)) is not None]
    return files + sorted((ROOT / "governor").glob("_hot__mypyc.*")) + [record()]


def clean() -> None:
    for path in built_files():
        path.unlink(missing_ok=True)


def build() -> None:
    from mypyc.build import mypycify  # (mypy's; setup.sh installs it with the compile extra)
    from setuptools import setup

    clean()
    os.chdir(ROOT)  # (mypyc reads the mypy settings of pyproject.toml, and writes to build/)
    sources = {module: digest(source(module)) for module in MODULES}
    paths = [str(source(module).relative_to(ROOT)) for module in MODULES]
    setup(
        name="governor-hot-path",
        ext_modules=mypycify(paths, group_name=GROUP, target_dir="build/mypyc"),
        script_args=["--quiet", "build_ext", "--inplace", "--build-temp", "build/mypyc"],
    )
    record().write_text(json.dumps(sources, indent=1) + "\n")


def main(argv: list[str]) -> int:
    if argv[1:] == ["--clean"]:
        clean()
        print("compile: removed; the hot path runs as Python", file=sys.stderr)
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    if set(status().values()) == {"compiled"}:
        print("compile: the hot path's build is up to date", file=sys.stderr)
        return 0
    try:
        build()
    except BaseException:
        clean()  # (never half a build: a module compiled beside one that is not is fine, but
        raise  # a shim without its shared library fails to import)
    states = status()
    if set(states.values()) != {"compiled"}:
        print(f"compile: not all compiled: {states}", file=sys.stderr)
        clean()
        return 1
    print(f"compile: {len(MODULES)} modules compiled with mypyc", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
