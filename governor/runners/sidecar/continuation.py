"""A sidecar's answer that can be paused and resumed: llama-server's continuation by tokens.

Pure: what the http runner sends llama-server and makes of its events, no IO. A job the
runner can pause, admitted where it may be paused (below the interactive lane, a
:class:`~governor.runners.base.Pause` given), runs on llama-server's own ``/completion``
endpoint, its prompt tokenized by the upstream (a chat's messages through ``/apply-template``
first, as its ``/v1/chat/completions`` does), streamed with each generated token's id. Pausing
resets the request's connection (llama-server stops generating when it finds it gone) and keeps
what was generated; resuming sends ``/completion`` the prompt's tokens and the generated ones, with
``n_predict`` less what was generated, and the upstream's prompt cache keeps the resume
cheap (its slot still holds those cells, unless another request took them). The client sees
one answer: the same text, token for token, as without the pause where the continuation is
exact (:func:`ask_of_body`), its usage summed over the attempts with the
prompt counted once, and for an OpenAI request the chunks llama-server's own endpoint would
have sent (:class:`OpenAiShape`).

A continuation is exact when the next token depends only on the tokens so far and the
sampling parameters: greedy answers, and sampled ones without a seed (a seed's stream of
draws starts again at a resume). Tools, grammars and JSON schemas, ``n`` above 1, logprobs,
penalties over the generated tokens, and any field this module does not know are not
continued: such a job runs as it came, and admission does not lend it the reserve.

A token whose text llama-server holds back (a possible stop string, part of a character) is
not kept across a pause: the resume starts after the last token whose text was passed on, and
the held tokens are generated again. A stream that reported fewer token ids than it generated
(llama-server sends none for a token that ends within a character) resumes from the last point
where both agree, and the text already passed on is not passed on again.
"""

from __future__ import annotations

import contextlib
import secrets
import string
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..base import Resume

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
# The sampling fields an exact continuation sends on as they came (llama-server takes OpenAI's
# names), and the others a continuable request may carry: its text, its length, its stream,
# and what does not change the tokens.
SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "stop"})
ALLOWED = SAMPLING | {
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "model",
    "user",
    "ignore_eos",
    "cache_prompt",
}
ID_ALPHABET = string.ascii_letters + string.digits
# llama-server's finish: its stop type, as OpenAI's finish_reason.
FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


@dataclass(frozen=True, slots=True)
class Upstream:
    """What llama-server says of itself (``GET /props``): the model's name in its answers,
    its build (their ``system_fingerprint``), a slot's context and its slots, and the model's
    file ("": not said)."""

    model: str
    fingerprint: str
    n_ctx: int
    slots: int
    model_path: str = ""


def upstream_of(props: Any) -> Upstream | None:
    """llama-server's ``/props``, or None where the answer is not one (another server)."""
    if type(props) is not dict:
        return None
    settings = props.get("default_generation_settings")
    if type(settings) is not dict:
        return None
    n_ctx, slots = settings.get("n_ctx"), props.get("total_slots")
    if type(n_ctx) is not int or type(slots) is not int:
        return None
    return Upstream(
        model=str(props.get("model_alias") or ""),
        fingerprint=str(props.get("build_info") or ""),
        n_ctx=n_ctx,
        slots=slots,
        model_path=str(props.get("model_path") or ""),
    )


@dataclass(frozen=True, slots=True)
class Ask:
    """A request whose answer can be continued exactly: its text (a chat's ``messages`` or a
    ``prompt``), its sampling fields as llama-server takes them, and how its
    OpenAI client wants the answer (``openai``: None for the TCP door's job)."""

    messages: tuple[Mapping[str, Any], ...] | None
    prompt: str | None
    sampling: Mapping[str, Any]
    openai: OpenAiShape | None = None


def _exact(sampling: Mapping[str, Any]) -> bool:
    """A seeded draw is not continued (its draws would start again); a greedy one is. (A
    value of the wrong type is the upstream's to refuse: such a request is not continued.)"""
    temperature, top_k, seed = (sampling.get(k) for k in ("temperature", "top_k", "seed"))
    if not all(v is None or type(v) in (int, float) for v in (temperature, top_k, seed)):
        return False
    greedy = (temperature is not None and temperature <= 0) or top_k == 1
    return greedy or seed in (None, -1)


def ask_of_body(fields: Mapping[str, Any], path: str, *, shaped: bool = True) -> Ask | None:
    """An OpenAI request (``fields``, its decoded body, to ``path``), where its answer can be
    continued exactly: only the fields of :data:`ALLOWED`, text alone in its messages, one
    choice. (Its length is the job spec's, as the governor bounded it.) ``shaped``: its client
    wants the answer in OpenAI's chunks (a forwarded request), not as the TCP door's tokens."""
    if path not in (CHAT_PATH, COMPLETION_PATH) or not fields.keys() <= ALLOWED:
        return None
    if fields.get("n", 1) not in (1, None):
        return None
    messages = prompt = None
    if path == CHAT_PATH:
        messages = fields.get("messages")
        if type(messages) is not list or not messages or not all(map(_plain, messages)):
            return None
        messages = tuple(messages)
    else:
        prompt = fields.get("prompt")
        if type(prompt) is not str:
            return None
    sampling = {k: v for k, v in fields.items() if k in SAMPLING and v is not None}
    if fields.get("ignore_eos"):
        sampling["ignore_eos"] = True
    if not _exact(sampling):
        return None
    if not shaped:
        return Ask(messages, prompt, sampling)
    options = fields.get("stream_options")
    shape = OpenAiShape(
        chat=messages is not None,
        stream=fields.get("stream") is True,
        include_usage=type(options) is dict and options.get("include_usage") is True,
    )
    return Ask(messages, prompt, sampling, shape)


def _plain(message: Any) -> bool:
    """A message of a role and text alone (no tool calls, images or names)."""
    return (
        type(message) is dict
        and message.keys() <= {"role", "content"}
        and type(message.get("role")) is str
        and type(message.get("content")) is str
    )


@dataclass(slots=True)
class Continuation:
    """One answer across its attempts: the prompt's tokens, the tokens generated so far,
    which of them the client has the text of, and the counts the result reports."""

    ask: Ask
    max_tokens: int
    prompt: list[int] | None = None  # its tokens, once a pause needs them
    generated: list[int] = field(default_factory=list)  # this answer's, in order
    # How many of ``generated`` the text passed on covers, and that text's length: where a
    # resume starts. (Tokens past it: text held back, or an id the upstream did not send.)
    kept: int = 0
    kept_chars: int = 0
    sent_chars: int = 0  # the text passed on to the client, all attempts together
    text: list[str] = field(default_factory=list)
    # The attempt in progress: the tokens it was sent, generated so far, and the text of
    # this attempt still to skip (passed on by an earlier one).
    attempt_from: int = 0
    attempt_generated: int = 0
    skip_chars: int = 0
    prompt_tokens: int | None = None  # the first attempt's prompt (usage counts it once)
    cached_tokens: int | None = None
    finish: str | None = None
    resumes: list[Resume] = field(default_factory=list)
    pieces: list[float] = field(default_factory=list)  # each prompt piece's seconds

    def body(self, template: str | None) -> dict[str, Any]:
        """The next attempt's ``/completion`` request: the first with the prompt's text
        (``template``: a chat's, as ``/apply-template`` gave it), a resume with the prompt's
        tokens and the kept ones."""
        ask = self.ask
        body: dict[str, Any] = {
            **ask.sampling,
            "stream": True,
            "cache_prompt": True,
            "n_predict": self.max_tokens - self.kept,
        }
        if self.prompt is not None:
            body["prompt"] = self.prompt + self.generated[: self.kept]
            if self.resumes:
                body["timings_per_token"] = True  # (its first says what the resume computed)
        else:
            body["prompt"] = template if template is not None else ask.prompt
        self.attempt_from = self.kept
        self.attempt_generated = 0
        self.skip_chars = self.sent_chars - self.kept_chars
        del self.generated[self.kept :]
        return body

    @property
    def remaining(self) -> int:
        """The tokens the answer may still generate (0: a resume has nothing to ask for)."""
        return self.max_tokens - self.kept

    def feed(self, event: Any) -> str | None:
        """One event of ``/completion``'s stream: the text to pass on (None: none), the
        generated tokens noted; at the last (``stop``), the counts."""
        if type(event) is not dict:
            return None
        tokens = event.get("tokens")
        if type(tokens) is list:
            self.generated.extend(t for t in tokens if type(t) is int)
        predicted, evaluated = event.get("tokens_predicted"), event.get("tokens_evaluated")
        if type(predicted) is int:
            self.attempt_generated = predicted
        if self.prompt_tokens is None and type(evaluated) is int:
            self.prompt_tokens = evaluated - self.attempt_from  # (a resume's prompt: and more)
        if self.resumes and self.resumes[-1].recomputed is None:
            timings = event.get("timings")
            if type(timings) is dict and type(timings.get("prompt_n")) is int:
                self.resumes[-1].recomputed = timings["prompt_n"]
        text = event.get("content")
        text = text if type(text) is str and text else None
        if event.get("stop") is True:
            self._last(event)
        if text is None:
            return None
        unsent = self._unsent(text)
        # Every token so far has its text out: a resume may start after them all, if the
        # upstream sent each one's id.
        if len(self.generated) - self.attempt_from == self.attempt_generated:
            self.kept = len(self.generated)
            self.kept_chars = self.sent_chars - self.skip_chars
        return unsent

    def _unsent(self, text: str) -> str | None:
        """What of ``text`` the client has not had: an attempt that started before the end
        of the text passed on generates that text again first."""
        if self.skip_chars:
            skipped = min(self.skip_chars, len(text))
            self.skip_chars -= skipped
            text = text[skipped:]
            if not text:
                return None
        self.sent_chars += len(text)
        self.text.append(text)
        return text

    def _last(self, event: dict[str, Any]) -> None:
        stop = event.get("stop_type")
        self.finish = FINISH.get(stop, "stop") if type(stop) is str else "stop"
        if not self.resumes:  # (what the cache held of the prompt: its first attempt's)
            self.cached_tokens = _cached(event)

    def first_of_resume(self, seconds: float) -> None:
        """The resumed attempt's first token came ``seconds`` after its request."""
        if self.resumes and self.resumes[-1].first_token_s is None:
            self.resumes[-1].first_token_s = seconds

    def paused(self) -> None:
        """The attempt in progress was stopped: the next starts after the kept tokens."""
        self.resumes.append(Resume())

    @property
    def completion_tokens(self) -> int:
        """The answer's tokens: those kept across the pauses and the last attempt's."""
        return self.attempt_from + self.attempt_generated

    def counts(self) -> dict[str, Any]:
        """The result's counts (the prompt once, the completion over every attempt)."""
        counts: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "counted": "usage",
        }
        if self.cached_tokens is not None:
            counts["cached_tokens"] = self.cached_tokens
        return counts

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` of the answer."""
        prompt, completion = self.prompt_tokens or 0, self.completion_tokens
        usage: dict[str, Any] = {
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
        }  # (llama-server's fields, in its order)
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def _cached(event: Mapping[str, Any]) -> int | None:
    """The prompt tokens the upstream's cache held: its ``timings`` say what it computed."""
    timings = event.get("timings")
    evaluated = event.get("tokens_evaluated")
    if type(timings) is dict and type(evaluated) is int:
        computed = timings.get("prompt_n")
        if type(computed) is int:
            return max(evaluated - computed, 0)
    return None


class Pace:
    """What sizes a long prompt's pieces on the upstream: the chats running (their tightest
    TPOT objective), the chats' TTFT objective, and the seconds the upstream takes a prompt
    token, learnt from its answers' ``timings``. A step that computes a whole long prompt holds
    every chat's next token for as long (llama-server computes a prompt in one step, up to its
    batch), and a chat that comes meanwhile waits for it before its own prompt's step; fed in
    pieces, each step's prompt tokens fit in :data:`SHARE` of the tightest running chat's TPOT
    objective, or with none running in :data:`ARRIVAL_SHARE` of a chat's TTFT objective."""

    SHARE = 0.5  # of a running chat's TPOT objective, for one piece's tokens
    ARRIVAL_SHARE = 0.25  # of a chat's TTFT objective, for one piece's tokens while none runs
    FIRST = 64  # tokens a piece, before the upstream's pace is known
    LEAST, MOST = 16, 512  # tokens a piece
    LEARN_FROM = 32  # prompt tokens an answer must have computed to teach the pace
    WEIGHT = 0.2  # of each new measure in the pace

    def __init__(self, ttft_s: float = 0.0) -> None:
        """``ttft_s``: a chat's TTFT objective (0: a prompt in pieces only while chats run)."""
        self._chats: dict[object, float] = {}  # each running chat's TPOT objective, in s
        self.ttft_s = ttft_s
        self.token_s: float | None = None  # seconds a prompt token, as measured

    @contextlib.contextmanager
    def running(self, priority: int, tpot_ms: float) -> Iterator[None]:
        """A job runs on the upstream meanwhile: an interactive one (``priority`` 0) of a TPOT
        objective (0: none) is a chat to keep the pace of."""
        if priority or tpot_ms <= 0:
            yield
            return
        key = object()
        self._chats[key] = tpot_ms / 1000
        try:
            yield
        finally:
            del self._chats[key]

    def learn(self, timings: Any) -> None:
        """An answer's ``timings`` (its last event's): how long its prompt tokens took."""
        if type(timings) is not dict:
            return
        computed, ms = timings.get("prompt_n"), timings.get("prompt_ms")
        if type(computed) is not int or computed < self.LEARN_FROM:
            return
        if not isinstance(ms, (int, float)) or ms <= 0:
            return
        measured = ms / 1000 / computed
        known = self.token_s
        self.token_s = measured if known is None else known + self.WEIGHT * (measured - known)

    def piece(self) -> int | None:
        """The tokens of a long prompt's next piece, or None: the rest at once (no chat runs,
        and none is waited for)."""
        if self._chats:
            budget_s = self.SHARE * min(self._chats.values())
        elif self.ttft_s > 0:
            budget_s = self.ARRIVAL_SHARE * self.ttft_s
        else:
            return None
        if self.token_s is None:
            return self.FIRST
        return max(self.LEAST, min(self.MOST, int(budget_s / self.token_s)))


def answer_id() -> str:
    """An answer's id, as llama-server makes them (``chatcmpl-`` for completions too)."""
    return "chatcmpl-" + "".join(secrets.choice(ID_ALPHABET) for _ in range(32))


@dataclass(slots=True)
class OpenAiShape:
    """The OpenAI chunks of an answer as llama-server's own endpoint sends them (its fields in
    its order; no ``timings``, its own addition): one ``id`` and ``created`` for the whole
    answer, however many attempts make it."""

    chat: bool
    stream: bool
    include_usage: bool = False
    id: str = ""
    created: int = 0
    model: str = ""
    fingerprint: str = ""

    def begin(self, upstream: Upstream) -> None:
        self.id = answer_id()
        self.created = int(time.time())
        self.model, self.fingerprint = upstream.model, upstream.fingerprint

    def _answer(self, choice: Mapping[str, Any] | None, kind: str, **more: Any) -> bytes:
        """A chunk or a whole answer: a chat's with its ``id`` after its ``created``, a
        completion's with its ``id`` last, as llama-server writes them."""
        answer: dict[str, Any] = {"choices": [] if choice is None else [choice]}
        answer["created"] = self.created
        if self.chat:
            answer["id"] = self.id
        answer.update(model=self.model, system_fingerprint=self.fingerprint, object=kind, **more)
        if not self.chat:
            answer["id"] = self.id
        return orjson.dumps(answer)

    def _chunk(self, choice: Mapping[str, Any] | None, **more: Any) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + self._answer(choice, kind, **more) + b"\n\n"

    def role(self) -> bytes | None:
        """A chat stream's first chunk (the assistant's role), before its first text."""
        if not self.chat:
            return None
        return self._chunk(_delta(None, {"role": "assistant", "content": None}))

    def piece(self, text: str) -> bytes:
        if self.chat:
            return self._chunk(_delta(None, {"content": text}))
        return self._chunk(_text(text, None))

    def end(self, continuation: Continuation) -> bytes:
        """A stream's last chunks: the finish (a completion's with its usage), a chat's usage
        where asked, ``[DONE]``."""
        finish = continuation.finish or "stop"
        if self.chat:
            last = self._chunk(_delta(finish, {}))
            if self.include_usage:
                last += self._chunk(None, usage=continuation.usage())
        else:
            last = self._chunk(_text("", finish), usage=continuation.usage())
        return last + b"data: [DONE]\n\n"

    def whole(self, continuation: Continuation) -> bytes:
        """A whole (non-streamed) answer."""
        text, finish = "".join(continuation.text), continuation.finish or "stop"
        usage = continuation.usage()
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"finish_reason": finish, "index": 0, "message": message}
            return self._answer(choice, "chat.completion", usage=usage)
        return self._answer(_text(text, finish), "text_completion", usage=usage)


def _delta(finish: str | None, delta: Mapping[str, Any]) -> dict[str, Any]:
    return {"finish_reason": finish, "index": 0, "delta": delta}


def _text(text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
