"""What a sidecar knows of its llama-server's context before a job takes a slot.

llama-server says a slot's context (``n_ctx``) and its model's file (``GET /props``). Where that
file can be read here too (a sidecar beside its server), the http runner loads the model's
vocabulary and chat template alone (:class:`~.llama_prompts.LlamaPrompts`, as the embedded
runner does) and counts each prompt's tokens at the door: a prompt that a slot cannot hold is
refused (``prompt_too_long``) before it takes a slot, where llama-server would answer 400 once
it had one, and admission sizes the job by its tokens, not by a guess from its characters.
Requests with tools, or not of text alone, are not counted: llama-server lays them out its own
way, and decides.
"""

from __future__ import annotations

from pathlib import Path

from protocol.codes import NeedCode
from protocol.spec import JobSpec, Message, SpecInvalid

from ..base import RunnerStartError
from ..llama.prompts import LlamaPrompts
from .continuation import Ask, Upstream


class UpstreamPrompts:
    """llama-server's slot context and its model's vocabulary, loaded here (:meth:`load`)."""

    def __init__(self, n_ctx: int, prompts: LlamaPrompts) -> None:
        self.n_ctx = n_ctx
        self._prompts = prompts

    @classmethod
    def load(cls, upstream: Upstream) -> UpstreamPrompts | None:
        """The upstream's, where its model's file can be read here; None where it cannot
        (blocking: run it in a thread)."""
        path = Path(upstream.model_path)
        if not upstream.model_path or not path.is_file() or upstream.n_ctx < 1:
            return None
        prompts = LlamaPrompts(path, n_ctx=upstream.n_ctx, cells=upstream.n_ctx, max_new_tokens=1)
        try:
            prompts.load()
        except RunnerStartError:
            return None
        return cls(upstream.n_ctx, prompts)

    def count(self, spec: JobSpec) -> tuple[int, ...]:
        """The tokens of ``spec``'s prompt, as llama-server will see them (none where it is
        not counted here); raises :class:`SpecInvalid` (``prompt_too_long``) for a prompt that
        a slot cannot hold."""
        if spec.tools is not None or spec.input is not None:
            return ()
        if spec.prompt is None and spec.messages is None:
            return ()
        tokens, _ = self._prompts.prompt_tokens(spec)
        if len(tokens) >= self.n_ctx:
            raise SpecInvalid(
                NeedCode.PROMPT_TOO_LONG,
                f"the prompt is {len(tokens)} tokens; the upstream's context is {self.n_ctx} "
                "tokens a slot",
            )
        return tuple(tokens)

    def count_ask(self, ask: Ask) -> tuple[int, ...]:
        """:meth:`count` for a forwarded request read as one that can be continued."""
        if ask.messages is not None:
            messages = tuple(Message(str(m["role"]), str(m["content"])) for m in ask.messages)
            return self.count(JobSpec(messages=messages))
        return self.count(JobSpec(prompt=ask.prompt or ""))
