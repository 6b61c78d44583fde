"""The prompts of ``bench generation``: distinct story openings the model continues, short chat
questions, and rewrites of long reports that share no prefix."""

from __future__ import annotations

from collections.abc import Callable

TOPICS = (
    "rain",
    "a volcano",
    "photosynthesis",
    "a comet",
    "gravity",
    "an eclipse",
    "a glacier",
    "inflation",
    "a rainbow",
    "a tsunami",
    "democracy",
    "a vaccine",
    "the tide",
    "a black hole",
    "a coral reef",
    "an atom",
    "a desert",
    "a hurricane",
    "erosion",
    "a neuron",
    "a galaxy",
    "a monsoon",
    "a fossil",
    "an earthquake",
    "a forest fire",
    "a magnet",
    "an enzyme",
    "a bridge",
    "a compass",
    "a lighthouse",
    "a windmill",
    "a microscope",
)

# Original prose for the rewrites: a report with enough distinct content that a rewrite of it
# runs past max_new_tokens. Paragraphs are rotated per rewrite, so that no two share a prefix.
# ("paragraph by paragraph": without it, greedy SmolLM2 ends some of these rewrites within 30
# tokens; the burst's jobs are real ones, without ignore_eos.)
PARAGRAPHS = (
    "The harbour committee met on the first Tuesday of the month in the old customs house. "
    "Twelve members attended, together with the harbour master and two representatives of the "
    "fishing cooperative. The chair opened the meeting by thanking the volunteers who had "
    "repainted the railings along the north quay, a job that had been postponed for three "
    "winters because of the weather and the cost of scaffolding.",
    "The harbour master reported that the dredging of the inner basin had been completed two "
    "weeks ahead of schedule. The contractor removed about four thousand cubic metres of silt, "
    "which was tested for heavy metals before being spread on the reclaimed land behind the "
    "boatyard. The depth at low water is now close to three metres across the whole basin, "
    "which means that the larger trawlers will no longer need to wait for the tide.",
    "The treasurer presented the accounts for the first half of the year. Mooring fees brought "
    "in slightly more than expected, mainly because of visiting yachts during the festival, "
    "but the repair of the slipway winch cost almost twice the estimate once the old gearbox "
    "was opened. She proposed that the reserve fund be used to cover the difference and that "
    "the committee review its insurance, which has not been renegotiated for six years.",
    "Several members raised the question of parking on the quay during the summer. Delivery "
    "vans for the fish market regularly find the loading bay blocked by visitors' cars, and on "
    "two occasions an ambulance had difficulty reaching the lifeboat station. After a long "
    "discussion the committee agreed to ask the council for permission to paint a yellow line "
    "along the seaward edge and to install a barrier that opens only for permit holders.",
    "The fishing cooperative thanked the committee for its support during the storm in March, "
    "when three boats broke their moorings and one was driven onto the rocks below the "
    "lighthouse. The cooperative has since replaced the worn chains with heavier ones and asked "
    "whether the harbour could lend its workboat for the annual inspection of the buoys, "
    "which would save the members the cost of hiring a vessel from the neighbouring town.",
    "Finally, the chair reminded everyone that nominations for the committee's elections close "
    "at the end of next month. Two long-serving members have announced that they will not "
    "stand again, and the committee would welcome candidates from the newer residents of the "
    "waterfront flats, who have so far been under-represented. The meeting closed at half past "
    "nine, and the next one will be held in the lifeboat station while the customs house is "
    "being rewired.",
)
REWRITE_INSTRUCTION = (
    "Rewrite the following report in plain, simple English, paragraph by paragraph, keeping "
    "every point:"
)


def story(k: int) -> str:
    """A distinct completion prompt that the embedded model continues past 128 tokens."""
    return f"Story {k}: Once upon a time, in a small village by the sea,"


def question(k: int) -> str:
    """A distinct short chat question."""
    topic = TOPICS[k % len(TOPICS)]
    return f"In one sentence, what is {topic}?" + (f" ({k})" if k >= len(TOPICS) else "")


def rewrite_prompts(
    count: int, tokens: int, tokenize: Callable[[str], int]
) -> list[tuple[str, int]]:
    """``count`` rewrite prompts of at least ``tokens`` tokens by ``tokenize`` (a text's length
    in tokens), each starting at another paragraph; with their lengths."""
    out = []
    for k in range(count):
        text = REWRITE_INSTRUCTION
        i = k
        while (n := tokenize(text)) < tokens:
            text += "\n\n" + PARAGRAPHS[i % len(PARAGRAPHS)]
            i += 1
        out.append((text, n))
    return out
