"""The http runner's token counts from an upstream's usage, and governor-cli's line about them."""

from __future__ import annotations

from typing import Any

import pytest

from clients.cli import summary
from governor.runners.sidecar.runner import token_counts


def test_the_upstreams_usage_is_taken_when_it_reports_one() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27}
    assert token_counts(usage, 19) == {
        "prompt_tokens": 7,
        "completion_tokens": 20,
        "counted": "usage",
    }


@pytest.mark.parametrize(
    "usage",
    [None, {}, [], {"prompt_tokens": None, "completion_tokens": None}, {"completion_tokens": "20"}],
)
def test_without_a_usable_usage_the_chunks_are_counted_and_the_prompt_is_null(usage: Any) -> None:
    assert token_counts(usage, 19) == {
        "prompt_tokens": None,
        "completion_tokens": 19,
        "counted": "chunks",
    }


@pytest.mark.parametrize(
    ("details", "cached"),
    [
        ({"cached_tokens": 512}, 512),
        ({"cached_tokens": 0}, 0),
        ({"cached_tokens": "5"}, None),
        ({"cached_tokens": -1}, None),
        ({"cached_tokens": True}, None),
        ({}, None),
        ([], None),
    ],
)
def test_the_upstreams_cached_prompt_tokens_are_passed_on(details: Any, cached: int | None) -> None:
    usage = {"prompt_tokens": 600, "completion_tokens": 20, "prompt_tokens_details": details}
    assert token_counts(usage, 19).get("cached_tokens") == cached


def test_a_usage_without_the_prompt_leaves_the_prompt_null() -> None:
    counts = token_counts({"completion_tokens": 20}, 19)
    assert (counts["prompt_tokens"], counts["completion_tokens"]) == (None, 20)


def test_the_cli_line_with_every_count() -> None:
    result = {
        "prompt_tokens": 4,
        "completion_tokens": 30,
        "finish_reason": "length",
        "ttft_ms": 99.5,
        "tpot_ms": 31.3,
    }
    assert summary(result) == (
        "4 prompt + 30 generated tokens, finish length, ttft 99.5 ms, tpot 31.3 ms"
    )


def test_the_cli_line_says_which_count_it_lacks_rather_than_none() -> None:
    result = {
        "prompt_tokens": None,
        "completion_tokens": 20,
        "counted": "chunks",
        "finish_reason": "length",
        "ttft_ms": 12.0,
        "tpot_ms": None,
    }
    line = summary(result)
    assert "None" not in line
    assert line == (
        "prompt tokens not reported by the upstream + 20 generated tokens (counted from the "
        "streamed chunks), finish length, ttft 12.0 ms"
    )
