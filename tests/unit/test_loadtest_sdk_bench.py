"""``loadtest bench sdk-bench``'s options for a client that never retries (``--max-retries 0``) and
its baselines (llama-cpp-python's server, llama.cpp's llama-server with the governor's slots, or
none), with no process started."""

from __future__ import annotations

import argparse
from pathlib import Path

import openai
import pytest

from loadtest.bench import sdk_bench
from loadtest.bench.sdk_bench import clients as sdk_clients
from loadtest.bench.sdk_bench import servers
from loadtest.cli import build_parser
from loadtest.support import llama_server

MODEL = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def sdk(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "sdk-bench", *argv])


def test_sdk_bench_retries_are_the_sdks_unless_told() -> None:
    assert sdk().max_retries is None  # the SDK's own, resolved when it runs
    assert sdk_clients.max_retries(sdk()) == openai.DEFAULT_MAX_RETRIES == 2
    assert sdk_clients.max_retries(sdk("--max-retries", "0")) == 0
    with pytest.raises(SystemExit):
        sdk("--max-retries", "-1")


def test_sdk_bench_baselines() -> None:
    assert sdk_bench.baseline(sdk()) == "llama-cpp-python"  # as before
    assert sdk_bench.baseline(sdk("--no-baseline")) == "none"
    assert sdk_bench.baseline(sdk("--baseline", "none")) == "none"
    args = sdk("--baseline", "llama-server", "--llama-server", "/bin/llama-server")
    argv = servers.baseline_command(args, MODEL, 7003)
    # The governor's K slots, each with --n-ctx.
    assert argv == llama_server.command(
        Path("/bin/llama-server"), MODEL, port=7003, slots=4, ctx=4 * 2048, threads=2
    )
    argv = servers.baseline_command(sdk(), MODEL, 7003)
    assert argv[1:3] == ["-m", "llama_cpp.server"]
