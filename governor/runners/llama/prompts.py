"""The daemon's side of a ``llama`` model: what turns a job spec into a prepared job.

:class:`~governor.runners.llama.runner.LlamaRunner` keeps a vocabulary-only copy of the model here
(no weights, no context), so that a job spec is checked and its prompt tokenised before it can
take a slot: its length against the context window, its logit biases against the vocabulary,
its JSON schema or tools made a grammar (:func:`job_grammar`) and parsed by llama.cpp, so that
no worker is given one that does not parse. Tools go into the prompt through the chat template
where it lays them out itself, else in a system message of their own (:func:`tools_message`);
with "none" they are left out. The workers (:mod:`governor.runners.llama.worker`) get token ids
and the grammar, and only generate.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson

from protocol.codes import NeedCode
from protocol.spec import JobSpec, SpecInvalid

from ..base import Job, RunnerError, RunnerStartError, spec_or_prompt
from .structured import (
    functions_of,
    job_grammar,
    refused,
    tool_mode,
    tools_message,
    with_system,
)

# The daemon only tokenises: it hides the GPUs from itself while it loads the vocabulary (the
# GPU runtime looks at these once, when first used), or llama.cpp would set up a GPU context
# in it (about 500 MiB on an H100) beside the workers'.
GPU_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
# Structured output: the longest grammar a job may bring (llama.cpp walks it at every token of
# every sequence that has it), and how many a runner keeps made.
MAX_GRAMMAR_CHARS = 100_000
GRAMMARS_KEPT = 64
MAX_EMBED_INPUTS = 2048  # texts one call may embed (OpenAI's bound)


class LlamaPrompts:
    """A model's vocabulary and chat template, loaded in the daemon (:meth:`load`, before
    use), and the checks they make: :meth:`prepare` turns a job spec into the :class:`Job` a
    worker runs, or refuses it (``SpecInvalid``) before admission; :meth:`embedding_tokens`
    does the same for texts to embed. Grammars made are kept, the last ``GRAMMARS_KEPT``.

    ``n_ctx`` bounds a job's prompt and output, ``cells`` (the largest worker cache) all of
    its choices together; ``max_new_tokens`` is the ceiling a job may ask for."""

    def __init__(self, model: Path, *, n_ctx: int, cells: int, max_new_tokens: int) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.cells = cells
        self.max_new_tokens = max_new_tokens
        self.vocab: Any = None  # llama-cpp-python's LlamaModel, vocabulary only
        self._chat: Any = None
        self._add_bos = False
        self._tool_template = False  # the chat template lays out tools itself
        self._grammars: OrderedDict[tuple[str | None, str | None, str], str | None] = OrderedDict()

    def load(self) -> None:
        """Load the vocabulary and chat template (blocking: run it in a thread)."""
        self.vocab, self._chat, self._add_bos = self._load_vocab()
        template = self._chat.template if self._chat is not None else ""
        self._tool_template = re.search(r"\btools\b", template) is not None

    def _load_vocab(self) -> tuple[Any, Any, bool]:
        """The model's vocabulary alone, with no context: ``Llama(vocab_only=True)`` would
        make one of 512 cells that nothing uses, and llama.cpp would warn "n_ctx_seq (512) >
        n_ctx_train (0)" (a vocabulary-only load leaves the training context unread)."""
        import llama_cpp
        from llama_cpp._internals import LlamaModel  # (Llama's own model wrapper)
        from llama_cpp._logger import set_verbose
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        set_verbose(False)  # llama.cpp's errors only, on stderr (as Llama(verbose=False))
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        visible = {name: os.environ.get(name) for name in GPU_DEVICES}
        os.environ.update(dict.fromkeys(GPU_DEVICES, ""))
        try:
            vocab = LlamaModel(path_model=str(self.model), params=params, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise RunnerStartError(f"cannot load {self.model}: {exc}") from None
        finally:
            for name, value in visible.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
        metadata = vocab.metadata()
        template = metadata.get("tokenizer.chat_template")
        chat = None
        if template:
            eos = vocab.detokenize([vocab.token_eos()], special=True).decode(errors="replace")
            bos = vocab.detokenize([vocab.token_bos()], special=True).decode(errors="replace")
            chat = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        return vocab, chat, metadata.get("tokenizer.ggml.add_bos_token") == "true"

    def prepare(self, job_id: str, spec: JobSpec | None, payload: bytes = b"") -> Job:
        """The job for ``spec`` (or for ``payload`` as a prompt), with its prompt's tokens
        and stop strings; ``SpecInvalid`` for what the model cannot do, or a prompt too long."""
        spec = spec_or_prompt(spec, payload, self.max_new_tokens)
        if spec.input is not None:  # (texts to embed: its tokens are what it costs)
            texts = self.embedding_tokens(list(spec.input))
            return Job(job_id, payload, spec=spec, tokens=tuple(t for each in texts for t in each))
        self._check_features(spec)
        tokens, stop = self.prompt_tokens(spec)
        if len(tokens) + spec.max_new_tokens > self.n_ctx:
            raise SpecInvalid(
                NeedCode.PROMPT_TOO_LONG,
                f"the prompt is {len(tokens)} tokens; with max_new_tokens {spec.max_new_tokens} "
                f"that is over the context window of {self.n_ctx}",
            )
        if spec.n > 1 and len(tokens) + spec.output_tokens > self.cells:
            raise refused(
                f"{spec.n} choices of up to {spec.max_new_tokens} tokens after a prompt of "
                f"{len(tokens)} need {len(tokens) + spec.output_tokens} KV cells; a worker's "
                f"cache has {self.cells}: ask for fewer choices or fewer tokens"
            )
        return Job(job_id, payload, spec=spec, tokens=tuple(tokens), stop=tuple(stop))

    def prompt_tokens(self, spec: JobSpec) -> tuple[list[int], list[str]]:
        """The tokens of the spec's prompt (its messages through the chat template, its
        tools), and its stop strings (the spec's and the template's)."""
        text, special, stop = prompt_of(spec, self._chat, self._tool_template)
        return self.vocab.tokenize(text.encode(), add_bos=self._add_bos, special=special), stop

    def _check_features(self, spec: JobSpec) -> None:
        """Refuse what the model cannot do of the spec: a token it does not have, a schema
        or tool that cannot be made a grammar."""
        vocabulary = self.vocab.n_vocab()
        for token, _ in spec.logit_bias:
            if token >= vocabulary:
                raise refused(
                    f"'logit_bias' names token {token}; this model's tokens are 0 to "
                    f"{vocabulary - 1}"
                )
        if spec.repeat_penalty <= 0:
            raise refused("'repeat_penalty' must be above 0 (1 is none)")
        self._grammar(spec)

    def run_grammar(self, spec: JobSpec) -> str | None:
        """The grammar of a job about to run; a :class:`RunnerError` (``spec_invalid``) for
        one that cannot be made, as a job prepared by another runner, on another model, may."""
        try:
            return self._grammar(spec)
        except SpecInvalid as exc:
            raise RunnerError(exc.detail, NeedCode.SPEC_INVALID) from None

    def _grammar(self, spec: JobSpec) -> str | None:
        """The job's grammar (:func:`job_grammar`), parsed by llama.cpp here, so that no
        worker is given one that does not parse; the last ``GRAMMARS_KEPT`` are kept."""
        key = (spec.json_schema, spec.tools, spec.tool_choice)
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        grammar = job_grammar(spec)
        if grammar is not None:
            if len(grammar) > MAX_GRAMMAR_CHARS:
                raise refused(
                    f"the grammar for this schema or these tools is {len(grammar)} characters, "
                    f"over {MAX_GRAMMAR_CHARS}: simplify them"
                )
            self._parse_grammar(grammar)
        self._grammars[key] = grammar
        if len(self._grammars) > GRAMMARS_KEPT:
            self._grammars.popitem(last=False)
        return grammar

    def _parse_grammar(self, grammar: str) -> None:
        import llama_cpp

        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab.vocab, grammar.encode(), b"root")
        if not sampler:
            raise refused("llama.cpp cannot parse the grammar made of this schema or these tools")
        llama_cpp.llama_sampler_free(sampler)

    def embedding_tokens(self, texts: list[str]) -> list[list[int]]:
        """Each text's tokens; ``SpecInvalid`` for no text or too many, an empty one or one
        over ``n_ctx`` tokens."""
        if not 0 < len(texts) <= MAX_EMBED_INPUTS:
            raise refused(f"give 1 to {MAX_EMBED_INPUTS} texts to embed")
        tokens = [
            list(self.vocab.tokenize(t.encode(), add_bos=self._add_bos, special=False))
            for t in texts
        ]
        for i, each in enumerate(tokens):
            if not 0 < len(each) <= self.n_ctx:
                raise SpecInvalid(
                    NeedCode.PROMPT_TOO_LONG if each else NeedCode.SPEC_INVALID,
                    f"text {i} to embed is {len(each)} tokens; each must be 1 to {self.n_ctx}",
                )
        return tokens


def prompt_of(spec: JobSpec, chat: Any, tool_template: bool) -> tuple[str, bool, list[str]]:
    """The prompt's text (with its tools, where the job may call one), whether it holds
    special tokens, and the stop strings (the spec's and the chat template's): ``chat``, the
    model's chat template (None: it has none), ``tool_template``, whether it lays out tools."""
    mode, stop = tool_mode(spec), list(spec.stop)
    functions = functions_of(spec) if mode != "text" else []
    if spec.messages is None:
        prefix = f"{tools_message(functions, mode)}\n\n" if functions else ""
        return prefix + (spec.prompt or ""), False, stop
    if chat is None:
        raise refused("this model has no chat template")
    messages = [{"role": m.role, "content": m.content} for m in spec.messages]
    tools: dict[str, Any] = {}
    if functions and tool_template:
        tools["tools"] = orjson.loads(spec.tools or "[]")
    elif functions:
        messages = with_system(messages, tools_message(functions, mode))
    try:
        formatted = chat(messages=messages, **tools)
    # The template is the model's own Jinja code: it may raise anything for messages it does
    # not take (a role it does not know, say).
    except Exception as exc:
        raise refused(f"the model's chat template does not take these messages: {exc}") from None
    if isinstance(formatted.stop, str):
        stop.append(formatted.stop)
    elif formatted.stop:
        stop += formatted.stop
    return formatted.prompt, True, stop


__all__ = ["LlamaPrompts", "prompt_of"]
