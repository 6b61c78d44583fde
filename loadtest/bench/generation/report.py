"""``bench generation``'s report as text: one table per measure."""

from __future__ import annotations

from typing import Any

from ...support.stats import ratio


def _cell(value: Any, width: int) -> str:
    return f"{'-' if value is None else value:>{width}}"


def _share(*rows: dict[str, Any]) -> str:
    """The most that other processes kept the CPUs busy over ``rows``, as a percentage."""
    shares = [r["others_cpu"] for r in rows if r.get("others_cpu") is not None]
    return f"{max(shares) * 100:.0f}%" if shares else "-"


def render(report: dict[str, Any]) -> list[str]:
    """The report as one table per measure (the JSON line aside). "others": the share of the
    machine's CPUs that other processes used meanwhile (the most over a target's rounds)."""
    targets: dict[str, dict[str, Any]] = report["targets"]
    lines = [
        f"{report['model']}, {report['threads']} thread(s), n_gpu_layers "
        f"{report['n_gpu_layers']}, {report['slots']} slots (each target started once with "
        f"them), governor n_ctx {report['n_ctx']}, llama-server -c {report['server_ctx']}"
    ]
    width = max([12, *(len(name) for name in targets)])
    for key, table in (
        ("throughput", _throughput_table),
        ("idle", _idle_table),
        ("bursts", _burst_table),
        ("greedy", _greedy_table),
        ("memory", _memory_table),
    ):
        if any(key in t for t in targets.values()):
            lines += ["", *table(report, targets, width)]
    lines += [f"note: {note}" for note in report["notes"]]
    return lines


def _throughput_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    streams = report["streams"]
    lines = [
        f"a. aggregate tokens/s, N greedy streams of {report['max_new_tokens']} new tokens "
        "(completion tokens / round wall time; [fewest-most tokens a stream])",
        f"{'target':<{width}}" + "".join(f"{f'N={n}':>22}" for n in streams) + "  others",
    ]
    for name, t in targets.items():
        rows = {r["streams"]: r for r in t.get("throughput", [])}
        cells = []
        for n in streams:
            r = rows.get(n)
            text = (
                "-"
                if r is None
                else (
                    f"{r['tokens_per_s']} [{r['tokens_min']}-{r['tokens_max']}]"
                    + (f" lost {r['lost']}" if r["lost"] else "")
                )
            )
            cells.append(f"{text:>22}")
        share = _share(*t.get("throughput", []))
        lines.append(f"{name:<{width}}" + "".join(cells) + f"  {share:>6}")
    return lines


def _idle_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    lines = [
        f"b. idle chat TTFT, sequential chats of {report['chat_tokens']} new tokens (ms)",
        f"{'target':<{width}} {'n':>4} {'p50':>8} {'p90':>8} {'lost':>5} {'others':>7}",
    ]
    for name, t in targets.items():
        if (r := t.get("idle")) is not None:
            lines.append(
                f"{name:<{width}} {r['n']:>4} {_cell(r['p50_ms'], 8)} "
                f"{_cell(r['p90_ms'], 8)} {r['lost']:>5} {_share(r):>7}"
            )
    return lines


def _burst_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    lines = [
        "c. chats beside 2 rewrites, S slots: chats alone (S - 2, then S at once), beside "
        "(2 rewrites then S - 2 chats), over (2 rewrites then S chats); chat TTFT and TPOT "
        "ms (TTFT from first send), rewrite ends s from the round's start",
        f"{'target':<{width}} {'S':>3} {'round':>9} {'ttft p50':>9} {'p99':>8} "
        f"{'tpot p50':>9} {'p99':>7} {'e2e p99':>8} {'yields':>6} {'rewrite ends':>14} "
        f"{'lost':>5}",
    ]
    for name, t in targets.items():
        for burst in t.get("bursts", []):
            for label, r in burst["rounds"].items():
                ends = ", ".join("-" if e is None else f"{e:g}" for e in r["rewrite_end_s"])
                lines.append(
                    f"{name:<{width}} {burst['slots']:>3} {label:>9} "
                    f"{_cell(r['ttft_p50_ms'], 9)} {_cell(r['ttft_p99_ms'], 8)} "
                    f"{_cell(r['tpot_p50_ms'], 9)} {_cell(r['tpot_p99_ms'], 7)} "
                    f"{_cell(r['e2e_p99_ms'], 8)} {r['yields']:>6} {ends:>14} "
                    f"{r['lost']:>5}"
                )
            q = burst["ratios"]
            lines.append(
                f"{'':<{width}} {burst['slots']:>3} {'ratios':>9} beside/alone TTFT "
                f"{_cell(q['beside_ttft'], 5)} TPOT {_cell(q['beside_tpot'], 5)}; over TPOT "
                f"/alone_all {_cell(q['over_tpot'], 5)}, over TTFT/(alone_all TTFT+e2e) "
                f"{_cell(q['over_ttft'], 5)}; others {_share(burst)}"
            )
    return lines


def _greedy_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    """Each greedy text's TTFT, and whether the first target with texts said the same (else the
    characters the two share at their start, of the first's)."""
    said = [t["greedy"] for t in targets.values() if "greedy" in t]
    lines = [
        "e. greedy texts: TTFT ms; the same as the first target's, or the characters shared",
        f"{'target':<{width}} {'prompt':<40} {'tokens':>6} {'TTFT':>8} same",
    ]
    for name, t in targets.items():
        for row, first in zip(t.get("greedy", ()), said[0] if said else (), strict=False):
            mine, theirs = row["text"] or "", first["text"] or ""
            shared = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            same = "yes" if mine == theirs else f"{shared} of {len(theirs)}"
            lines.append(
                f"{name:<{width}} {row['prompt']:<40} {_cell(row['prompt_tokens'], 6)} "
                f"{_cell(row['ttft_ms'], 8)} {same}"
            )
    return lines


def _memory_table(
    report: dict[str, Any], targets: dict[str, dict[str, Any]], width: int
) -> list[str]:
    lines = [
        "d. memory: PSS of the target and its children (MiB) with N slots, llama-server with "
        "-c N x n_ctx (anon: without file pages, which other programs mapping the model share)",
        f"{'target':<{width}} {'N':>3} {'PSS':>9} {'anon':>8} {'procs':>5} "
        f"{'/llama-server':>13} {'anon':>7}",
    ]
    server = {r["slots"]: r for r in targets.get("llama-server", {}).get("memory", ())}
    for name, t in targets.items():
        for r in t.get("memory", ()):
            peer = server.get(r["slots"], {})
            lines.append(
                f"{name:<{width}} {r['slots']:>3} {_cell(r['pss_mib'], 9)} "
                f"{_cell(r['pss_anon_mib'], 8)} {r['processes']:>5} "
                f"{_cell(ratio(r['pss_mib'], peer.get('pss_mib')), 13)} "
                f"{_cell(ratio(r['pss_anon_mib'], peer.get('pss_anon_mib')), 7)}"
            )
    return lines
