"""The command lines of ``bench guidellm-bench``: the governor's and llama-server's, sized for
the workload, and guidellm's own (its mix of chats and rewrites, its environment)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
from pathlib import Path
from typing import Any

from ...support import llama_server

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# The chat template's tokens around a prompt, and some to spare, in each llama-server slot.
TEMPLATE_TOKENS = 128

# A mix's rewrite: 200 to 300 words to rewrite (about 270 to 400 tokens), of sentences drawn
# from these; a chat is a one-line question.
REWRITE_WORDS = (200, 300)
MIX_PROMPT_TOKENS = 448  # the longest prompt of a mix, for the servers' contexts
SENTENCES = (
    "The harbour committee met on the first Tuesday of the month to review the ferry timetable.",
    "Several members asked whether the new pier could open before the summer season began.",
    "The treasurer noted that repairs to the lighthouse had cost more than was first planned.",
    "A local school offered to paint the waiting room if the council supplied the materials.",
    "Fishermen complained that the morning tide made the eastern slipway unsafe to use.",
    "The chair promised a written answer to every question raised before the next meeting.",
)
TOPICS = ("the sea", "a comet", "Rome", "a violin", "rain", "a volcano", "chess", "bread")


def synthetic(args: argparse.Namespace) -> dict[str, int]:
    """guidellm's synthetic prompts: --prompt-tokens each, after the --prefix-tokens that all
    share where asked (a system prompt every request repeats: what prefix reuse is for)."""
    fields = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    if args.prefix_tokens:
        fields |= {"prefix_tokens": args.prefix_tokens, "prefix_count": 1}
    return fields


def server_ctx(args: argparse.Namespace) -> int:
    """llama-server's ``-c``: ``--server-ctx``, else each of the slots room for a prompt of
    ``--prompt-tokens``, the chat template and ``--output-tokens``, in whole 256s."""
    if args.server_ctx is not None:
        return int(args.server_ctx)
    prompt = MIX_PROMPT_TOKENS if args.rewrite_share else args.prompt_tokens + args.prefix_tokens
    need: int = prompt + args.output_tokens + TEMPLATE_TOKENS
    slots: int = args.slots
    return slots * -(-need // 256) * 256


def governor_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    """The governor with llama-server's KV cache: as many cells (its ``-c``), each job's
    context as long as a llama-server slot's (a larger cache costs every decode step, so the
    two are compared on equal memory): by default as llama-server has them, a stream of that
    context for each slot; with ``--kv-layout pool``, one pool of them."""
    cells = server_ctx(args)
    cache = ["--kv-capacity", str(cells)] if args.kv_layout == "pool" else ["--kv-layout", "slots"]
    return [
        sys.executable,
        "-m",
        "governor",
        "serve",
        "--runner",
        "llama",
        "--model",
        str(model),
        "--max-inflight",
        str(args.slots),
        "--lanes",
        "true",
        "--threads",
        str(args.threads),
        *cache,
        "--n-ctx",
        str(cells // args.slots),
        "--http-listen",
        f"127.0.0.1:{port}",
        "--listen",  # (its protocol listener, unused here: any free port)
        "127.0.0.1:0",
        "--log-level",
        "warning",
        *shlex.split(args.extra_governor_args or ""),
    ]


def llama_server_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    argv = llama_server.command(
        args.llama_server,
        model,
        port=port,
        slots=args.slots,
        ctx=server_ctx(args),
        threads=args.threads,
    )
    return argv + shlex.split(args.extra_llama_server_args or "")


def mix_rows(
    requests: int, share: float, output_tokens: int, seed: int = 0
) -> list[dict[str, Any]]:
    """A mix of ``requests`` prompts, ``share`` of them rewrites of 200 to 300 words spread
    evenly through it, the rest one-line chat questions; each asking for ``output_tokens``."""
    rng = random.Random(seed)
    rows = []
    for i in range(requests):
        if int((i + 1) * share) > int(i * share):
            words: list[str] = []
            while len(words) < rng.randint(*REWRITE_WORDS):
                words += rng.choice(SENTENCES).split()
            prompt = "Rewrite this more formally:\n" + " ".join(words)
        else:
            prompt = f"In one sentence, what is {rng.choice(TOPICS)}? ({i})"
        rows.append({"prompt": prompt, "output_tokens_count": output_tokens})
    return rows


def guidellm_command(
    args: argparse.Namespace, url: str, model: Path, report: Path, mix: Path | None = None
) -> list[str]:
    """``guidellm run`` for one run against ``url`` (no ``/v1``), its JSON report to ``report``.
    Each option is guidellm 0.8.1's ``--OPTION SPEC``, the spec written as JSON (a path with a
    comma in it would break its ``key=value,...`` form)."""

    def spec(**fields: Any) -> str:
        return json.dumps(fields)

    backend = spec(kind="openai_http", target=url, validate_backend=not args.no_health_check)
    return [
        args.guidellm,
        "run",
        "--backend",
        backend,
        "--profile",
        spec(kind="concurrent", streams=args.concurrency),
        "--constraint",
        spec(kind="max_requests", count=args.requests),
        "--data",
        spec(kind="json_file", path=str(mix))
        if mix is not None
        else spec(kind="synthetic_text", **synthetic(args)),
        "--tokenizer",
        spec(
            kind="huggingface_auto", model=str(model.parent), load_kwargs={"gguf_file": model.name}
        ),
        "--output",
        spec(kind="json", path=str(report)),
        "--disable-console-interactive",
    ]


def guidellm_env(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment, offline for the hub, and guidellm's worker processes capped
    (by default it starts one per stream up to 10, each importing torch: on two cores they take
    the CPU the servers need)."""
    return {
        **os.environ,
        **OFFLINE_ENV,
        "GUIDELLM__MAX_WORKER_PROCESSES": str(args.client_processes),
    }
