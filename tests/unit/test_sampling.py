"""The draws of :mod:`governor.runners.llama.sampling` against the distribution llama.cpp's chain
samples from (min_p, temperature, a draw), computed here over every token.

The uniforms are given, not random: a draw maps one uniform (two where the tail is weighed) to
a token, so a grid of uniforms gives each token the share of the grid its probability is, to
the grid's step. A small ``head`` puts much of the weight in the tail, so that every path (the
head alone, the tail weighed and drawn from, every token) is taken."""

from __future__ import annotations

import itertools
import math
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from governor.runners.llama import sampling
from governor.runners.llama.messages import Run
from governor.runners.llama.sampling import Draws, plain

GRID = 48


def reference(logits: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    """Each token's probability, as llama.cpp's chain computes it, over every token."""
    ids = np.arange(len(logits))
    if min_p > 0:
        ids = ids[logits[ids] >= logits.max() + math.log(min_p)]
    probs = np.zeros(len(logits))
    probs[ids] = np.exp((logits[ids].astype(np.float64) - logits.max()) / temperature)
    probs /= probs.sum()
    return probs


class Uniforms:
    """A random stream that gives the uniforms it was made with."""

    def __init__(self, *values: float) -> None:
        self.values = iter(values)

    def random(self) -> float:
        return next(self.values)


def shares(draws: Draws, logits: np.ndarray) -> np.ndarray:
    """Each token's share of a GRID x GRID grid of (first, second) uniforms."""
    counts = np.zeros(len(logits))
    grid = [(i + 0.5) / GRID for i in range(GRID)]
    for first, second in itertools.product(grid, grid):
        draws.rng = Uniforms(first, second)  # type: ignore[assignment]
        counts[draws(logits)] += 1
    return counts / GRID**2


@settings(max_examples=60)
@given(
    points=st.lists(st.integers(-300, 0), min_size=2, max_size=24, unique=True),
    temperature=st.sampled_from([0.3, 0.8, 1.0, 1.7]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    head=st.sampled_from([0.5, 2.0, 6.0, 16.0]),
    wide=st.sampled_from([1, 8, 1000]),
    block=st.sampled_from([3, 1024]),
)
# (min_p reaching past the head alone: the peak, two tokens the head leaves out, one below it)
@example(points=[0, -20, -40, -100], temperature=1.0, min_p=0.05, head=0.5, wide=1, block=1024)
def test_every_draw_follows_the_chains_distribution(
    points: list[int],
    temperature: float,
    min_p: float,
    head: float,
    wide: int,
    block: int,
) -> None:
    """``wide``: the head drawn from alone only when at most a wide-th of the vocabulary (1:
    always), ``block``: the weights summed in blocks of that many (3: in several)."""
    logits = np.array(points, dtype=np.float32) / 20  # (distinct logits, 0 to -15)
    want = reference(logits, temperature, min_p)
    draws = Draws(temperature=temperature, min_p=min_p, head=head)
    with patch.object(sampling, "WIDE", wide), patch.object(sampling, "BLOCK", block):
        got = shares(draws, logits)
    assert not got[want == 0].any()  # (a token the chain cannot draw, never drawn)
    # (each uniform's step moves a token's share by at most 1/GRID)
    assert np.abs(got - want).max() <= 2 / GRID + 1e-9


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_a_wide_head_is_weighed_whole_and_found_block_by_block(temperature: float) -> None:
    """Every token weighed in place (the head is most of them), the draw found among blocks
    of 3 weights, then in its block."""
    logits = -np.arange(20, dtype=np.float32) / 4
    want = reference(logits, temperature, 0.0)
    with patch.object(sampling, "WIDE", 1000), patch.object(sampling, "BLOCK", 3):
        got = shares(Draws(temperature=temperature), logits)
    assert np.abs(got - want).max() <= 2 / GRID + 1e-9


def test_the_tail_is_drawn_with_its_weights_share() -> None:
    """Four tokens at the peak and sixty far below it, where the head leaves them: the tail
    weighs 0.6 of all; every head token 0.1, every tail token 0.01."""
    logits = np.array([0.0] * 4 + [math.log(0.1)] * 60, dtype=np.float32)
    with patch.object(sampling, "WIDE", 1):
        got = shares(Draws(temperature=1.0, head=1.0), logits)
    assert abs(got[4:].sum() - 0.6) <= 1 / GRID
    assert np.abs(got[:4] - 0.1).max() <= 2 / GRID


def test_greedy_takes_the_first_likeliest_token() -> None:
    assert Draws(temperature=0.0)(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)) == 1


def test_a_seed_gives_the_same_draws_and_another_seed_others() -> None:
    logits = np.random.default_rng(7).standard_normal(49_152).astype(np.float32) * 3

    def run(seed: int) -> list[int]:
        draws = Draws(temperature=1.0, seed=seed)
        return [draws(logits) for _ in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def run(settings: dict[str, Any]) -> Run:
    return Run(id="j", tokens=[1], max_new_tokens=8, **settings)


def test_biases_penalties_grammars_top_k_and_top_p_are_left_to_llama_cpps_chain() -> None:
    assert plain(run({"temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.05}))
    assert not plain(run({"top_p": 0.95}))
    assert not plain(run({"top_k": 40}))
    assert not plain(run({"logit_bias": [[5, 1.0]]}))
    assert not plain(run({"grammar": 'root ::= "a"'}))
    assert not plain(run({"frequency_penalty": 0.5}))
    assert not plain(run({"repeat_penalty": 1.1}))
