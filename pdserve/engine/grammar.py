"""Structured output: a grammar constrains which tokens a request may sample (xgrammar).

A request's `guide` is (kind, spec): `json_schema` (a JSON Schema, as JSON text), `json_object`
(any JSON object; spec ""), `regex`, `choice` (a JSON list of strings; the output is one), or
`structural_tag` (xgrammar's structural tag, as JSON text: the router forces tool calls in a model
family's format with one, router/tools/request.py).

Only the rank that samples (the last PP rank) holds grammar state, and that state is a function of
the request's own generated tokens: before each sampling step the matcher is fed the tokens the
request gained since the last one (`Req.output_ids`, identical on every rank), then the step's
bitmask removes every token the grammar forbids. So nothing new travels between ranks, a
retracted request resumes with the same state, and on a PD pair the decode side's matcher starts
by feeding the first token the prefill side sampled under the same grammar.

xgrammar (MLC) was chosen over llguidance and outlines-core: it is the engine vLLM and SGLang use by
default, it ships CPU wheels with a torch bitmask kernel, and it compiles JSON Schema, EBNF, regex
and structural tags (tool calls) in one API. Its per-token cost on this CPU is in bench/.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
KINDS = ("json_schema", "json_object", "regex", "choice", "structural_tag")
MAX_SPEC = 64 << 10  # characters of a schema, regex or choice list


class GrammarError(ValueError):
    """A guide that is not one of the kinds, or whose spec does not compile."""


def _grammar(kind: str, spec: str):
    import xgrammar as xgr

    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec)
    choices = json.loads(spec)
    return xgr.Grammar.from_regex("|".join(_regex_literal(c) for c in choices))


def _regex_literal(s: str) -> str:
    return "(" + "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in s) + ")"


def check_guide(guide: Any) -> tuple[str, str]:
    """The guide as (kind, spec) if it is well formed and compiles; GrammarError naming why."""
    if (
        not isinstance(guide, (list, tuple))
        or len(guide) != 2
        or guide[0] not in KINDS
        or not isinstance(guide[1], str)
        or len(guide[1]) > MAX_SPEC
    ):
        raise GrammarError(f"must be [kind, spec] with kind one of {', '.join(KINDS)}")
    kind, spec = guide
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not (
            isinstance(choices, list)
            and 0 < len(choices) <= 256
            and all(isinstance(c, str) and c for c in choices)
        ):
            raise GrammarError("choice: a JSON list of 1 to 256 non-empty strings")
    try:
        _grammar(kind, spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its reason
        raise GrammarError(f"{kind} does not compile: {str(e).splitlines()[0][:200]}") from None
    return kind, spec


@dataclass
class GuideState:
    """One request's matcher on the sampling rank, and how many of its tokens it has seen."""

    matcher: Any
    fed: int = 0


@dataclass
class GrammarSampler:
    """Grammar masks for a sampling rank: compiles each guide once (cached), keeps one matcher per
    request (on the Req, so it goes with it), and masks a batch's logits in place."""

    load_tokenizer: Any  # () -> the model's HF tokenizer, loaded at the first guided request
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    _compiler: Any = None
    _compiled: dict[tuple[str, str], Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def warm_up_in_background(self) -> None:
        """Builds the tokenizer info (seconds on a small CPU) off the rank's loop, so the first
        guided request does not stall every running stream of the rank."""
        threading.Thread(target=self._compiler_ready, name="grammar-warm-up", daemon=True).start()

    def _compiler_ready(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids),
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def _compile(self, guide: tuple[str, str]):
        compiler = self._compiler or self._compiler_ready()
        if guide not in self._compiled:
            if len(self._compiled) >= 256:  # bounded: the oldest compiled guide goes first
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[guide] = compiler.compile_grammar(_grammar(*guide))
        return self._compiled[guide]

    def mask(self, logits, reqs: list) -> None:
        """Forbids, row by row, the tokens each guided request's grammar does not allow next."""
        import xgrammar as xgr

        rows = [i for i, r in enumerate(reqs) if r.params.guide is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        masked = [i for i in rows if self._fill(reqs[i], bitmask, i)]
        if masked:
            xgr.apply_token_bitmask_inplace(logits, bitmask[: logits.shape[0]], indices=masked)

    def _fill(self, req, bitmask, row: int) -> bool:
        """Feeds the request's new tokens and fills its row; False when its grammar is done (it
        accepted a stop token and `ignore_eos` goes on) or gave up: the row stays unconstrained.
        A request's grammar never stops the rank."""
        import xgrammar as xgr

        state = req.guide_state
        if state is None:
            state = req.guide_state = GuideState(
                xgr.GrammarMatcher(self._compile(req.params.guide))
            )
        if state.matcher is None:
            return False
        try:
            for tok in req.output_ids[state.fed :]:  # what was harvested since the last step
                if state.matcher.is_terminated() or not state.matcher.accept_token(tok):
                    break
            state.fed = len(req.output_ids)
            if state.matcher.is_terminated():
                state.matcher = None
                return False
            state.matcher.fill_next_token_bitmask(bitmask, row)
            return True
        except RuntimeError as e:  # xgrammar's checks; the same tokens fail the same way anywhere
            log.warning("%s: grammar stopped constraining the output: %s", req.rid, e)
            state.matcher = None
            return False
