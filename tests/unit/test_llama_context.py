"""The llama worker's check of n_ctx against the model's training context, and the one llama.cpp
warning it drops (no model loaded)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from governor.runners.llama.worker import _without_training_overflow_warning, context_refusal


def test_an_n_ctx_up_to_the_training_context_is_served() -> None:
    assert context_refusal(2048, 8192, "m.gguf") is None
    assert context_refusal(8192, 8192, "m.gguf") is None


def test_an_n_ctx_past_the_training_context_is_refused_with_what_to_set() -> None:
    why = context_refusal(16384, 8192, "m.gguf")
    assert why is not None
    assert why.startswith("n_ctx 16384 is more than the 8192 tokens m.gguf was trained for")
    assert why.endswith("to 8192 or less")


def test_a_model_that_does_not_say_is_not_refused() -> None:
    assert context_refusal(16384, 0, "m.gguf") is None


@pytest.mark.parametrize("python_logger_level", [logging.NOTSET, logging.ERROR])
def test_only_the_overflow_warning_is_dropped_from_llama_cpps_log(
    capsys: pytest.CaptureFixture[str], python_logger_level: int
) -> None:
    """Warnings and errors (and their continued lines) pass, whatever llama-cpp-python's own
    logger is set to; information, the overflow warning and an aborted step's errors do not."""
    import llama_cpp
    from llama_cpp import _logger

    before = _logger.logger.level
    _logger.logger.setLevel(python_logger_level)
    aborting = False
    callback = _without_training_overflow_warning(llama_cpp, lambda: aborting)
    try:
        info, warn, error, cont = 2, 3, 4, 5  # (llama.cpp's ggml_log_level)
        callback(info, b"llama_context: n_ctx = 2064\n", None)
        callback(warn, b"llama_context: n_ctx_seq (8448) > n_ctx_train (8192) -- possible "
                 b"training context overflow\n", None)  # fmt: skip
        callback(cont, b"(a continued line of it)\n", None)
        callback(error, b"llama_model_load: error loading model", None)
        callback(cont, b": no such file\n", None)
        callback(warn, b"load: a warning\n", None)
        aborting = True  # (a preempted step: its graph's compute fails on purpose)
        callback(error, b"llama_decode: failed to decode, ret = 2\n", None)
        callback(warn, b"load: a warning while aborting\n", None)
    finally:  # (llama-cpp-python's own, as the process had it)
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
        _logger.logger.setLevel(before)
    assert capsys.readouterr().err == (
        "llama_model_load: error loading model: no such file\nload: a warning\n"
        "load: a warning while aborting\n"
    )
