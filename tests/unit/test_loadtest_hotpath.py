"""``loadtest bench hotpath``'s attribution of py-spy's samples to the steps of the admitted path."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loadtest.bench.hotpath import LOOP, attribute, step_of, table

LOOP_FRAME = "Runner.run (asyncio/runners.py:118)"
ROOT = "main (governor/cli.py:313)"
FRAMES = [
    LOOP_FRAME,
    "GovernorProtocol.data_received (governor/listeners/tcp.py:136)",
    "GovernorProtocol.write (governor/listeners/tcp.py:211)",
    "Session._handle_line (governor/listeners/session.py:340)",
    "decode_request (protocol/frames.py:84)",
    "Upload.apply_chunk (protocol/upload.py:230)",
    "Admission.decide (governor/core/admission.py:300)",
    "Execution._record (governor/execution.py:331)",
    "text_line (governor/telemetry/logs.py:91)",
    "sha256 (<built-in>:0)",
]


def test_a_sample_goes_to_its_innermost_frame_of_a_step() -> None:
    stack = ";".join([ROOT, LOOP_FRAME, FRAMES[1], FRAMES[3], FRAMES[4], "loads (orjson:0)"])
    steps, leaves = attribute([f"{stack} 7"])
    assert steps == {"frames: decode requests, encode replies": 7}
    assert leaves == {"loads (orjson:0)": 7}


def test_a_socket_write_is_its_own_step_and_the_rest_of_the_listener_another() -> None:
    assert step_of(FRAMES[2]) == "socket writes (transport.write)"
    assert step_of(FRAMES[1]) == "tcp listener: reads, turns, timers"


def test_the_roots_and_the_loop_belong_to_no_step() -> None:
    assert step_of(ROOT) is None
    steps, _ = attribute([f"{ROOT};{LOOP_FRAME} 3", "not a sample line", ""])
    assert steps == {LOOP: 3}


@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from(FRAMES), min_size=1, max_size=6), st.integers(1, 50)),
        max_size=30,
    ),
    st.one_of(st.none(), st.floats(1.0, 500.0)),
)
def test_every_sample_is_counted_once_and_the_table_adds_up(
    stacks: list[tuple[list[str], int]], cpu_us: float | None
) -> None:
    lines = [f"{ROOT};{';'.join(frames)} {n}" for frames, n in stacks]
    steps, leaves = attribute(lines)
    total = sum(n for _, n in stacks)
    assert sum(steps.values()) == sum(leaves.values()) == total
    if not total:
        return
    rows = table(steps, cpu_us)
    assert [r["share"] for r in rows] == sorted((r["share"] for r in rows), reverse=True)
    assert abs(sum(r["share"] for r in rows) - 1) <= 0.0001 * len(rows)
    if cpu_us is None:
        assert all(r["us_per_job"] is None for r in rows)
    else:
        # each row rounded to 0.1: off by at most 0.05 each (and a float's last bit)
        assert abs(sum(r["us_per_job"] for r in rows) - cpu_us) <= 0.05 * len(rows) + 1e-9
