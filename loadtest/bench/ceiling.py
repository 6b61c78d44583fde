"""``ceiling``: how fast this llama.cpp build decodes a batch of sequences, with nothing around it.

The upper bound for a continuous-batching runner on this machine: one llama.cpp context through
llama-cpp-python's low-level ctypes API (no ``Llama`` object, no sampling, no detokenising, no
processes, no protocol), a unified KV cache shared by every sequence.

* decode (the default): for each N of ``--streams``, N sequences each get a short distinct
  prompt, then ``--steps`` decode steps run, each one ``llama_decode`` of N tokens (one per
  sequence, logits for each). Only the ``llama_decode`` calls are timed (one untimed step
  first); the rate is N * steps over their sum.
* ``--prefill``: the time of one ``llama_decode`` of a chunk of B prompt tokens (logits for its
  last), on an empty cache, and in one batch with one decode token for each of 8 running
  sequences (B = 0 there: the 8 decode tokens alone). Each is the median of ``--repeats``, the
  cache rolled back between repeats so that each sees the same state. It says how large a
  prompt chunk one step of a batched runner can take before the running sequences notice.

* ``--sampling``: what drawing one token for each of 8 sequences costs, after a step that
  gave each its logits (prompts of random words: a model unsure of its next token, the
  governor's dearer case): llama.cpp's sampler chain against the governor's draws
  (:mod:`governor.runners.llama.sampling`), with OpenAI's defaults (temperature 1), with min_p, and
  greedy, and the chain alone with llama-server's defaults (top_k 40, top_p 0.95, min_p 0.05,
  temperature 0.8: the job spec's, which the draws leave to it); the median of ``--repeats``
  rounds of ``--steps`` draws each.

One ``llama_decode`` is one graph evaluation: ``n_ubatch`` is set to ``n_batch``, which holds
the largest batch asked for. On a machine shared with other work, each round (all of the
prefill runs count as one) first waits (``--wait-quiet``) for other processes to leave the
CPUs, and is run again while they disturbed it (``--attempts``); "others" is the share of the
CPUs they used during the round kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..support.arguments import add_model, add_quiet_wait, add_threads
from ..support.machine import QUIET_SHARE, CpuWindow, wait_quiet
from ..support.options import positive_int, positive_ints, print_json
from ..support.workload import synth_prompt

if TYPE_CHECKING:
    from governor.runners.llama.messages import Run

NAME = "ceiling"
STREAMS = (1, 4, 8, 16)
CHUNKS = (16, 32, 64, 128, 256, 512)
RUNNING = 8  # sequences decoding beside a prefill chunk
PROMPT_TOKENS = 8  # each sequence's short prompt (synth_prompt's estimate; the real count is used)

# (token, position, sequence, wants logits)
Entry = tuple[int, int, int, bool]


def context_size(streams: Sequence[int], steps: int, chunks: Sequence[int]) -> int:
    """KV cells enough for the largest decode round and for the prefill runs, in 256s."""
    per_sequence = 4 * PROMPT_TOKENS + steps + 2  # a prompt's real length may exceed the estimate
    decode = max(streams, default=0) * per_sequence
    prefill = RUNNING * (4 * PROMPT_TOKENS + 2) + max(chunks, default=0)
    return -(-max(decode, prefill, 256) // 256) * 256


class Engine:
    """One llama.cpp context over the ctypes API, with one batch reused for every decode."""

    def __init__(
        self,
        model: Path,
        *,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        threads: int,
        n_gpu_layers: int,
    ) -> None:
        import llama_cpp

        # llama-cpp-python's log callback prints every llama.cpp line unless its logger is
        # set higher (what Llama(verbose=False) does); errors still come through.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self.model = lib.llama_model_load_from_file(str(model).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} on {model}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), out, len(out), True, False)
        if n < 0:
            raise RuntimeError(f"tokenizing {text!r} needs {-n} tokens")
        return list(out[:n])

    def decode(self, entries: Sequence[Entry]) -> float:
        """One ``llama_decode`` of ``entries``; the seconds it took (filling the batch aside)."""
        if not 0 < len(entries) <= self.n_batch:
            raise ValueError(f"a batch of {len(entries)} tokens (n_batch {self.n_batch})")
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        started = time.perf_counter()
        status = self.lib.llama_decode(self.ctx, batch)
        self.lib.llama_synchronize(self.ctx)  # (a GPU backend returns before the work is done)
        elapsed = time.perf_counter() - started
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return elapsed

    def forget(self, seq: int, from_pos: int = -1) -> None:
        """Drop ``seq``'s cells from ``from_pos`` on (all of them by default)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, from_pos, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)


def prompts(engine: Engine, count: int, first_seq: int = 0) -> dict[int, list[int]]:
    """A short distinct prompt per sequence, each decoded (untimed); the tokens by sequence."""
    by_seq = {
        seq: engine.tokenize(synth_prompt(PROMPT_TOKENS, f"s{seq}"))
        for seq in range(first_seq, first_seq + count)
    }
    for seq, tokens in by_seq.items():
        engine.decode([(t, p, seq, p == len(tokens) - 1) for p, t in enumerate(tokens)])
    return by_seq


def decode_rate(engine: Engine, streams: int, steps: int) -> dict[str, Any]:
    """``steps`` decode steps of ``streams`` sequences: each step one token per sequence."""
    engine.clear()
    by_seq = prompts(engine, streams)
    pos = {seq: len(tokens) for seq, tokens in by_seq.items()}
    # No sampling: each sequence is fed its prompt's last token again; a step costs the same
    # whatever the token is.
    token = {seq: tokens[-1] for seq, tokens in by_seq.items()}

    def step() -> float:
        elapsed = engine.decode([(token[s], pos[s], s, True) for s in by_seq])
        for s in by_seq:
            pos[s] += 1
        return elapsed

    step()  # untimed: the first batch of a new shape sets up its compute graph
    seconds = sum(step() for _ in range(steps))
    return {
        "streams": streams,
        "steps": steps,
        "seconds": round(seconds, 4),
        "step_ms": round(seconds / steps * 1000, 3),
        "tokens_per_s": round(streams * steps / seconds, 1),
    }


def prefill_times(engine: Engine, chunks: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Per chunk size: one decode of the chunk on an empty cache, and beside RUNNING sequences."""
    text = synth_prompt(max(chunks) * 2, "chunk")
    source = engine.tokenize(text)
    while len(source) < max(chunks):
        source += source
    chunk_seq = 0

    def chunk(size: int) -> list[Entry]:
        return [(source[p], p, chunk_seq, p == size - 1) for p in range(size)]

    def median_ms(entries: list[Entry], rollback: dict[int, int]) -> float:
        times = []
        for i in range(repeats + 1):
            elapsed = engine.decode(entries)
            for seq, pos in rollback.items():
                engine.forget(seq, pos)
            if i:  # the first is untimed, as in decode_rate
                times.append(elapsed)
        return round(statistics.median(times) * 1000, 3)

    engine.clear()
    empty = {size: median_ms(chunk(size), {chunk_seq: -1}) for size in chunks}

    engine.clear()
    running = prompts(engine, RUNNING, first_seq=chunk_seq + 1)
    steps = [(tokens[-1], len(tokens), seq, True) for seq, tokens in running.items()]
    rollback = {seq: len(tokens) for seq, tokens in running.items()}
    alone = median_ms(steps, rollback)
    rows = [{"chunk": 0, "empty_ms": None, "beside_ms": alone, "added_ms": 0.0}]
    for size in chunks:
        beside = median_ms(steps + chunk(size), {**rollback, chunk_seq: -1})
        rows.append(
            {
                "chunk": size,
                "empty_ms": empty[size],
                "prefill_tok_s": round(size / empty[size] * 1000, 1),
                "beside_ms": beside,
                "added_ms": round(beside - alone, 3),
            }
        )
    return rows


# (name, temperature, min_p): what the governor draws itself (top_k and top_p: the chain)
SAMPLINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("OpenAI's defaults", {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    ("temperature 0.7, min_p 0.05", {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.05}),
    ("greedy", {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    ("llama-server's defaults", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
)


def sampling_times(engine: Engine, steps: int, repeats: int) -> list[dict[str, Any]]:
    """Per sampling setting: the median time of RUNNING draws, by llama.cpp's chain and by
    the governor's draws, each from the logits of a step of RUNNING prompts."""
    from governor.runners.llama.messages import Run
    from governor.runners.llama.sampling import Draws, plain

    lib = engine.lib
    engine.clear()
    by_seq = prompts(engine, RUNNING)
    engine.decode([(tokens[-1], len(tokens), s, True) for s, tokens in by_seq.items()])
    n_vocab = lib.llama_vocab_n_tokens(engine.vocab)
    rows = []
    for name, settings in SAMPLINGS:
        request = Run(id=name, tokens=[], max_new_tokens=1, **settings)
        chains = [_chain(lib, request, s) for s in range(RUNNING)]
        ways = [("chain_ms", functools.partial(_by_chain, engine, chains))]
        if plain(request):  # (top_k and top_p are the chain's)
            draws = [
                Draws(temperature=request.temperature, min_p=request.min_p, seed=s)
                for s in range(RUNNING)
            ]
            ways.append(("draws_ms", functools.partial(_by_draws, engine, draws, n_vocab)))
        row: dict[str, Any] = {"sampling": name, "draws_ms": None}
        for key, draw_all in ways:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(steps):
                    draw_all()
                times.append((time.perf_counter() - started) / steps * 1000)
            row[key] = round(statistics.median(times), 3)
        rows.append(row)
        for chain in chains:
            lib.llama_sampler_free(chain)
    return rows


def _by_chain(engine: Engine, chains: list[Any]) -> None:
    for i, chain in enumerate(chains):
        engine.lib.llama_sampler_sample(chain, engine.ctx, i)


def _by_draws(engine: Engine, draws: list[Any], n_vocab: int) -> None:
    import numpy as np

    for i, draw in enumerate(draws):
        draw(np.ctypeslib.as_array(engine.lib.llama_get_logits_ith(engine.ctx, i), (n_vocab,)))


def _chain(lib: Any, request: Run, seed: int) -> Any:
    """llama.cpp's chain as the governor's worker makes it for the ``request``'s settings."""
    from governor.runners.llama.worker import add_draw

    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    add_draw(lib, chain, request, seed)
    return chain


def quietly(measure: Callable[[], dict[str, Any]], wait_s: float, attempts: int) -> dict[str, Any]:
    """``measure()`` once the machine is quiet (waiting ``wait_s`` at most), again while other
    processes were busy during it (``attempts`` in all); the run they disturbed least, with
    their share of the CPUs as ``others_cpu``."""
    best: dict[str, Any] | None = None
    for _ in range(attempts):
        if wait_s > 0:
            wait_quiet(wait_s)
        window = CpuWindow()
        row = {**measure(), "others_cpu": window.others()}
        if best is None or row["others_cpu"] < best["others_cpu"]:
            best = row
        if row["others_cpu"] < QUIET_SHARE:
            break
    assert best is not None, "attempts >= 1"
    return best


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME, help="the raw batched decode rate of this llama.cpp build", description=__doc__
    )
    add_model(parser)
    add_threads(parser, default=2, text="llama.cpp's threads")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="layers on the GPU; -1: all")
    parser.add_argument(
        "--streams",
        type=positive_ints,
        default=STREAMS,
        help="sequences decoding together, one round each",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=128, help="timed decode steps a round"
    )
    parser.add_argument(
        "--prefill", action="store_true", help="time prefill chunks instead of decode rounds"
    )
    parser.add_argument(
        "--sampling",
        action="store_true",
        help="time the draws of 8 sequences' tokens (llama.cpp's chain, the governor's) instead",
    )
    parser.add_argument(
        "--chunks",
        type=positive_ints,
        default=CHUNKS,
        help="--prefill: chunk sizes in tokens",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=7, help="--prefill, --sampling: runs per median"
    )
    add_quiet_wait(parser, what="round")
    parser.add_argument("--report", type=Path, metavar="FILE", help="also write the report here")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from governor.runners.llama.runner import embedded_model_path

    model = args.model or embedded_model_path()
    chunks = args.chunks if args.prefill else ()
    streams = () if args.prefill or args.sampling else args.streams
    n_seq_max = max(max(streams, default=1), RUNNING + 1)
    # (n_batch bounds the outputs of a batch too: one per sequence must fit.)
    n_batch = max(max(chunks, default=0) + RUNNING, n_seq_max, 4 * PROMPT_TOKENS)
    engine = Engine(
        model,
        n_ctx=context_size(streams, args.steps, chunks),
        n_batch=n_batch,
        n_seq_max=n_seq_max,
        threads=args.threads,
        n_gpu_layers=args.n_gpu_layers,
    )
    report: dict[str, Any] = {
        "command": NAME,
        "model": model.name,
        "threads": args.threads,
        "n_gpu_layers": args.n_gpu_layers,
        "n_ctx": engine.n_ctx,
        "n_batch": engine.n_batch,
    }
    patience = (args.wait_quiet, args.attempts)
    try:
        if args.sampling:
            report["repeats"], report["steps"], report["running"] = (
                args.repeats,
                args.steps,
                RUNNING,
            )
            run = quietly(
                lambda: {"rows": sampling_times(engine, args.steps, args.repeats)}, *patience
            )
            report["sampling"], report["others_cpu"] = run["rows"], run["others_cpu"]
        elif args.prefill:
            report["repeats"] = args.repeats
            report["running"] = RUNNING
            run = quietly(lambda: {"rows": prefill_times(engine, chunks, args.repeats)}, *patience)
            report["prefill"], report["others_cpu"] = run["rows"], run["others_cpu"]
        else:
            report["decode"] = [
                quietly(functools.partial(decode_rate, engine, n, args.steps), *patience)
                for n in streams
            ]
            report["others_cpu"] = max(row["others_cpu"] for row in report["decode"])
    finally:
        engine.close()
    return report


def render(report: dict[str, Any]) -> list[str]:
    """The report as table lines (the JSON line aside)."""
    head = (
        f"{report['model']}, {report['threads']} thread(s), n_gpu_layers "
        f"{report['n_gpu_layers']}, n_ctx {report['n_ctx']} (unified KV), n_batch {report['n_batch']}"
    )
    if "sampling" in report:
        lines = [
            head,
            f"{report['running']} draws, each from its own sequence's logits, median of "
            f"{report['repeats']} rounds of {report['steps']}",
            f"{'sampling':<26} {'chain ms':>9} {'draws ms':>9} {'ratio':>6}",
        ]
        for row in report["sampling"]:
            draws = row["draws_ms"]
            if draws is None:  # (the chain's alone)
                lines.append(f"{row['sampling']:<26} {row['chain_ms']:>9.3f} {'-':>9} {'-':>6}")
                continue
            ratio = draws / row["chain_ms"] if row["chain_ms"] else 0.0
            lines.append(
                f"{row['sampling']:<26} {row['chain_ms']:>9.3f} {draws:>9.3f} {ratio:>6.2f}"
            )
        return [*lines, _others(report)]
    if "prefill" in report:
        lines = [
            head,
            f"one llama_decode, median of {report['repeats']}; beside: in one batch with one "
            f"token for each of {report['running']} running sequences",
            f"{'chunk':>6} {'empty ms':>9} {'prefill tok/s':>14} {'beside ms':>10} {'added ms':>9}",
        ]
        for row in report["prefill"]:
            empty = "-" if row["empty_ms"] is None else f"{row['empty_ms']:.2f}"
            rate = f"{row['prefill_tok_s']:.0f}" if "prefill_tok_s" in row else "-"
            lines.append(
                f"{row['chunk']:>6} {empty:>9} {rate:>14} {row['beside_ms']:>10.2f} "
                f"{row['added_ms']:>9.2f}"
            )
        return [*lines, _others(report)]
    lines = [head, f"{'streams':>7} {'steps':>6} {'step ms':>8} {'tokens/s':>9} {'others':>7}"]
    for row in report["decode"]:
        lines.append(
            f"{row['streams']:>7} {row['steps']:>6} {row['step_ms']:>8.2f} "
            f"{row['tokens_per_s']:>9.1f} {row['others_cpu'] * 100:>6.0f}%"
        )
    return [*lines, _others(report)]


def _others(report: dict[str, Any]) -> str:
    share = report.get("others_cpu")
    if share is None:
        return "others: -"
    return f"others: other processes kept {share * 100:.0f}% of the machine's CPUs busy meanwhile"


def run(args: argparse.Namespace) -> int:
    try:
        report = measure(args)
    except RuntimeError as exc:
        print(f"loadtest bench ceiling: {exc}")
        return 1
    print("\n".join(render(report)))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    print_json(args, report)
    return 0
