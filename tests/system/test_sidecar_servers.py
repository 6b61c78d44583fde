"""The sidecar in front of real servers: each of OpenAI's request features gets the same kind
of answer through the governor as from the server directly (``loadtest bench sidecar``'s rows, with
the official SDK): llama-cpp-python's server, and llama.cpp's llama-server where
``deploy/build-llama-server.sh`` has built it. Every server is stopped by its own PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.bench import sidecar
from loadtest.support import llama_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module", params=["llama-cpp-python", "llama-server"])
def servers(request: pytest.FixtureRequest) -> Iterator[sidecar.Servers]:
    binary = llama_server.default_binary()
    if request.param == "llama-server" and not binary.exists():
        pytest.skip(f"no llama-server at {binary}: {llama_server.BUILD_SCRIPT} builds it")
    with sidecar.servers(request.param, slots=2, threads=1, binary=binary) as found:
        yield found


@pytest.mark.slow
@pytest.mark.parametrize("row", list(sidecar.ROWS))
def test_each_feature_gets_the_same_kind_of_answer(servers: sidecar.Servers, row: str) -> None:
    (result,) = [r for r in sidecar.table(servers, rows=[row])]
    assert result["same"], result
