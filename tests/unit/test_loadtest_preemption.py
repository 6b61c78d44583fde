"""``loadtest bench preemption``'s pure parts: its prompts, the burst's saturation figures, heavy texts
and wall times compared with chats and without, and each figure against its target; no
process started."""

from __future__ import annotations

from typing import Any

from loadtest.bench.preemption import figures, jobs
from loadtest.bench.preemption import report as verdict
from loadtest.bench.preemption.figures import Tick
from loadtest.cli import build_parser


def test_rewrites_are_about_their_length_and_share_no_prefix_but_their_first_words() -> None:
    short, long = figures.rewrite_prompt(0, 200), figures.rewrite_prompt(1, 800)
    assert long.count(figures.PARAGRAPH) == round((800 - 12) / figures.PARAGRAPH_TOKENS)
    assert short.count(figures.PARAGRAPH) == 3
    assert figures.rewrite_prompt(2, 1).count(figures.PARAGRAPH) == 1
    assert figures.rewrite_prompt(0, 800) != long
    assert long.split(".")[0] == "Rewrite document number 1 in plain words"


def test_chats_cycle_through_the_questions() -> None:
    n = len(figures.QUESTIONS)
    assert figures.chat_prompt(0) == figures.chat_prompt(n)
    assert len({figures.chat_prompt(i) for i in range(n)}) == n
    spec = figures.greedy(figures.chat_prompt(0), 16)
    assert (spec.temperature, spec.ignore_eos, spec.stream, spec.lane) == (0.0, True, True, None)


def test_saturation_counts_only_the_samples_where_a_job_waited() -> None:
    ticks = [
        Tick(0.0, 2, 4, 0),  # slots being taken, jobs waiting: not full
        Tick(0.1, 4, 2, 0),
        Tick(0.2, 4, 2, 0),
        Tick(0.3, 3, 1, 0),  # a slot free while a job waited (the hand-over)
        Tick(0.4, 2, 0, 0),  # nobody waiting: not counted either way
        Tick(0.5, 1, 0, 1),
    ]
    found = figures.saturation(ticks, 4)
    assert found == {
        "samples": 6,
        "peak_slots_taken": 4,
        "samples_with_waiting": 4,
        "full_while_waiting": 2,
        "full_share": 0.5,
        "overload_max": 1,
    }
    assert figures.saturation([], 4)["full_share"] is None


def test_first_difference() -> None:
    assert figures.first_difference("abc", "abc") is None
    assert figures.first_difference("abc", "abd") == 2
    assert figures.first_difference("ab", "abc") == 2


def test_ttft_summary_is_nearest_rank_in_ms() -> None:
    assert figures.ttft_summary([0.1, 0.2, 0.3, 0.4]) == {
        "n": 4,
        "p50_ms": 200.0,
        "p99_ms": 400.0,
    }
    assert figures.ttft_summary([]) == {"n": 0, "p50_ms": None, "p99_ms": None}


def heavy(name: str, text: str, wall_s: float, **more: Any) -> dict[str, Any]:
    return {"name": name, "text": text, "wall_s": wall_s, **more}


def test_heavy_jobs_compared_job_by_job_and_by_makespan() -> None:
    beside = [heavy("a", "same", 11.0), heavy("b", "turned", 12.0)]
    alone = [heavy("a", "same", 10.0), heavy("b", "turns", 10.0)]
    found = figures.compare_heavy(beside, alone)
    assert found["jobs"] == [
        {
            "job": "a",
            "same_text": True,
            "first_difference": None,
            "turned_after_chats": None,
            "wall_ratio": 1.1,
        },
        {
            "job": "b",
            "same_text": False,
            "first_difference": 4,
            "turned_after_chats": None,  # (not known: no chars_before_chats)
            "wall_ratio": 1.2,
        },
    ]
    assert (found["all_same_text"], found["turned_after_chats"]) == (False, 0)
    assert (found["makespan_ratio"], found["max_job_wall_ratio"]) == (1.2, 1.2)


def test_a_text_that_turned_before_the_first_chat_is_not_the_chats_doing() -> None:
    beside = [
        heavy("early", "xbc", 1.0, chars_before_chats=2),
        heavy("late", "abx", 1.0, chars_before_chats=2),
        heavy("same", "abc", 1.0, chars_before_chats=2),
    ]
    alone = [heavy(h["name"], "abc", 1.0) for h in beside]
    found = figures.compare_heavy(beside, alone)
    assert [j["turned_after_chats"] for j in found["jobs"]] == [False, True, False]
    assert found["turned_after_chats"] == 1


def test_a_failed_job_has_no_makespan() -> None:
    failed = {"name": "a", "error": "ConnectionLost"}
    found = figures.compare_heavy([failed], [heavy("a", "abc", 1.0)])
    assert (found["makespan_ratio"], found["max_job_wall_ratio"]) == (None, None)
    assert not found["all_same_text"]


def test_counters_grow_by_lane() -> None:
    before: dict[str, Any] = {"suspensions": {"heavy": 1.0}, "resumes": {"heavy": 1.0}}
    before |= {"overload_transitions": 0.0, "overload_state": 0.0}
    after: dict[str, Any] = {"suspensions": {"heavy": 4.0, "background": 0.0}}
    after |= {"resumes": {"heavy": 3.0}, "overload_transitions": 2.0, "overload_state": 1.0}
    assert jobs.since(before, after) == {
        "overload_state": 1.0,
        "suspensions": {"heavy": 3, "background": 0},
        "resumes": {"heavy": 2},
        "overload_transitions": 2,
    }


def report(**heavy: Any) -> dict[str, Any]:
    burst = {"peak_slots_taken": 4, "full_share": 0.97, "overload_max": 0}
    chats = {"p99_over_idle": 1.5}
    heavy = {"all_same_text": True, "turned_after_chats": 0, "makespan_ratio": 1.1} | heavy
    heavy.setdefault("max_job_wall_ratio", 1.14)
    return {"settings": {"slots": 4}, "burst": burst, "chats": chats, "heavy": heavy}


def test_each_figure_is_judged_against_its_target() -> None:
    assert [v["met"] for v in verdict.verdicts(report())] == [True] * 8
    missed = verdict.verdicts(report(all_same_text=False, max_job_wall_ratio=1.2))
    assert [v["figure"] for v in missed if not v["met"]] == [
        "heavy: texts the same with chats as without",
        "heavy: worst job's wall time with chats / without",
    ]
    unjudged = verdict.verdicts(report(makespan_ratio=None))
    assert [v["met"] for v in unjudged].count(None) == 1


def test_the_defaults_are_the_briefs() -> None:
    args = build_parser().parse_args(["bench", "preemption"])
    assert (args.slots, args.rewrites, args.prompt_tokens, args.max_new_tokens) == (4, 6, 800, 400)
    assert (args.heavy_new_tokens, args.chats, args.threads, args.control) == (300, 10, 1, False)


def test_the_sidecars_upstream_has_the_slots_asked_for() -> None:
    args = build_parser().parse_args(["bench", "preemption", "--sidecar"])
    command = jobs.upstream_command(args, 8000)
    assert command[command.index("-np") + 1] == "4"
    assert command[command.index("-c") + 1] == str(4 * 2048)
    args = build_parser().parse_args(["bench", "preemption", "--sidecar", "--upstream-slots", "5"])
    command = jobs.upstream_command(args, 8000)
    assert command[command.index("-np") + 1] == "5"
    assert command[command.index("-c") + 1] == str(5 * 2048)
