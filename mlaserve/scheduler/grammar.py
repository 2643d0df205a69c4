"""Structured output in the scheduler (xgrammar): grammars compiled off the loop and cached by their text, one
matcher per constrained request, and each step's token bitmask, filled on the CPU while the device runs the
previous step. The sampler applies the bitmask (`layers/sampler.apply_token_bitmask`).

Legend: `B` requests of a batch, `V` the model's vocabulary, `W` = ceil(V / 32) int32 words per bitmask row
(bit t of a row set: token t allowed).
"""
from __future__ import annotations

import importlib.util
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mlaserve.core import Batch, FinishReason, Req

if TYPE_CHECKING:
    import tokenizers

logger = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("xgrammar", "none")
CACHE_SIZE = 512           # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2


NO_XGRAMMAR = ("structured output needs xgrammar, which is not installed here (pip install xgrammar, or serve with "
               "--grammar-backend none)")


def xgrammar_installed() -> bool:
    """Whether xgrammar can be imported, without importing it (the import takes seconds: see GrammarManager)."""
    return importlib.util.find_spec("xgrammar") is not None


def grammar_error(e: Exception) -> str:
    """xgrammar's exception as one line for the user (its source-location prefix dropped)."""
    text = " ".join(str(e).split())
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)
    return text.removeprefix("Check failed: (error.empty()) is false: ") or type(e).__name__


def json_schema_options() -> dict[str, Any]:
    """How JSON schemas compile: compact separators (", " and ": ") with no free whitespace, and strict mode
    (no properties or items beyond those the schema lists unless it allows them), as SGLang and OpenAI do."""
    return {"any_whitespace": False, "strict_mode": True}


def tokenizer_info(tokenizer: tokenizers.Tokenizer, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's view of the served tokenizer (`tokenizer.json`): every id's text, with the tokens that
    `skip_special_tokens` removes from the output text (BOS, EOS, pad) made unreachable except as stop tokens;
    ids from the tokenizer's size up to the model's `vocab_size` are never allowed."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    probe = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = hf.convert_ids_to_tokens(list(range(n)))
    hidden = [i for i in tokenizer.get_added_tokens_decoder()
              if i < n and tokenizer.decode([i], skip_special_tokens=True) == ""]
    for i in hidden:
        vocab[i] = ""                     # NOTE: xgrammar treats an empty token as special (never matched)
    return xgr.TokenizerInfo(vocab, probe.vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids,
                             add_prefix_space=probe.add_prefix_space)


def parse_grammar(kind: str, text: str) -> Any:
    """The grammar of a request (no tokenizer needed); raises on invalid input (`grammar_error` says why)."""
    from xgrammar import Grammar

    if kind == "json_schema":
        return Grammar.from_json_schema(text, **json_schema_options())
    if kind == "regex":
        return Grammar.from_regex(text)
    if kind == "ebnf":
        return Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return Grammar.from_structural_tag(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


@dataclass
class GrammarState:
    """One constrained request: its compiled grammar and its matcher (None until first needed, or after a
    retraction; rebuilt by replaying the output so far)."""

    compiled: Any
    start_id: int | None          # the grammar applies after this output token; None: from the start
    matcher: Any = None


class GrammarManager:
    """Owns the compiled-grammar cache (by kind and text), the requests waiting for their grammar, and the
    per-request matchers. Every method runs on the scheduler's thread; compiles run in a small thread pool.

    Args:
        backend: "xgrammar" or "none" (then every constrained request is refused).
        tokenizer: the served tokenizer, `tokenizers.Tokenizer.from_file(".../tokenizer.json")` (None: every
            constrained request is refused, saying why).
        vocab_size: the model's vocabulary (bitmask width; may exceed the tokenizer's).
        stop_ids: the model's eos ids (what a completed grammar allows).
        synchronous: `submit` waits for the compile, so a request is ready at the next step whatever the timing
            (every rank of a tensor-parallel group then admits it at the same step).
    """

    def __init__(self, backend: str, tokenizer: tokenizers.Tokenizer | None, vocab_size: int, stop_ids: list[int],
                 synchronous: bool = False):
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"unknown grammar backend {backend!r}; choices: {', '.join(GRAMMAR_BACKENDS)}")
        self.backend, self.vocab_size, self.synchronous = backend, vocab_size, synchronous
        self.width = (vocab_size + 31) // 32
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.waiting: dict[str, tuple[Req, Future]] = {}      # rid -> (request, its compile)
        self.states: dict[str, GrammarState] = {}
        self.pool: ThreadPoolExecutor | None = None
        self._compiler: Future | None = None
        self.off_reason = "structured output is off (the server runs with --grammar-backend none)"
        if backend == "xgrammar" and tokenizer is None:
            self.off_reason = "structured output needs the tokenizer (no tokenizer.json with the checkpoint)"
        elif backend == "xgrammar" and not xgrammar_installed():
            self.off_reason = NO_XGRAMMAR
            logger.warning("%s: requests with a grammar are refused", NO_XGRAMMAR)
        elif backend == "xgrammar":
            self.off_reason = None
            self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="mlaserve-grammar")
            # NOTE: built on the first grammar, not at start: importing xgrammar and indexing the vocabulary is
            # seconds of Python in a pool thread, and while it holds the GIL the decode loop stalls (measured on
            # an H100 with the demo model: 4-8x slower steps for the first seconds of serving)
            self._compiler_args = (tokenizer, vocab_size, stop_ids)

    # --- checking and compiling ---------------------------------------------------------------------
    def check(self, kind: str, text: str) -> str | None:
        """Why the grammar is invalid (one line), or None. Parses only: cheap enough for the loop."""
        if self.off_reason is not None:
            return self.off_reason
        try:
            parse_grammar(kind, text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
            return grammar_error(e)
        return None

    def submit(self, req: Req) -> None:
        """Start compiling `req`'s grammar (a cached one is reused); `take_ready` hands it back when done."""
        kind, text = req.params.grammar
        key = (kind, text)
        fut = self.cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._compile(kind, text)
            self.cache[key] = fut
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        self.waiting[req.rid] = (req, fut)
        if self.synchronous:
            fut.exception()               # waits for the compile (its error, if any, is read by `take_ready`)

    def _compile(self, kind: str, text: str) -> Future:
        if self.pool is None:
            done: Future = Future()
            done.set_exception(RuntimeError(self.check(kind, text)))
            return done
        if self._compiler is None:
            self._compiler = self.pool.submit(_make_compiler, *self._compiler_args)
        return self.pool.submit(_compile, self._compiler, kind, text)

    def take_ready(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """Requests whose grammar compiled (ready to be scheduled) and those whose grammar failed (400)."""
        ready, failed = [], []
        for rid, (req, fut) in list(self.waiting.items()):
            if not fut.done():
                continue
            del self.waiting[rid]
            err = fut.exception()
            if err is None:
                self.states[rid] = GrammarState(fut.result(), req.grammar_start_id)
                ready.append(req)
            else:
                why = self.off_reason or f"invalid {req.params.grammar[0]}: {grammar_error(err)}"
                failed.append((req, FinishReason("abort", message=why, status_code=400)))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s for a waiting compile (the scheduler has nothing else to do)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        if self.waiting:
            wait_futures([f for _, f in self.waiting.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    # --- per step -------------------------------------------------------------------------------------
    def constrains(self, batch: Batch) -> bool:
        """True when a request of `batch` samples under a grammar this step."""
        return any(s and r.rid in self.states for r, s in zip(batch.reqs, batch.sampling))

    def bitmask(self, batch: Batch) -> torch.Tensor | None:
        """[B, W] int32 allowed-token bits of each request's next token (all set for free requests), or None
        when no request of the batch is constrained. Needs every earlier token of the batch accepted."""
        if not self.constrains(batch):
            return None
        mask = torch.full((batch.size, self.width), -1, dtype=torch.int32)
        for i, (req, sampling) in enumerate(zip(batch.reqs, batch.sampling)):
            matcher = self._matcher(req) if sampling and req.finished is None else None
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, i)
        return mask

    def draft_bitmask(self, batch: Batch, paths: list[list[list[int]]]) -> torch.Tensor | None:
        """Speculative decoding: [B * n, W] allowed-token bits at each of the n verified positions of every request
        (row i * n + j: after its output and the drafts on position j's path, paths[i][j]; a chain's path j is
        d_1 .. d_j), or None when no request is constrained. The matchers walk each path and roll back; past a
        draft the grammar refuses, rows stay all-set (the target's token there differs from that draft, so
        nothing after it is accepted)."""
        if not self.constrains(batch):
            return None
        n = len(paths[0])
        mask = torch.full((batch.size * n, self.width), -1, dtype=torch.int32)
        for i, req in enumerate(batch.reqs):
            state = self.states.get(req.rid)
            if state is None or req.finished is not None:
                continue
            own = self._matcher(req)
            for j, path in enumerate(paths[i]):
                m, walked, ok = _walk(state, own, path)
                if ok and m is not None and not m.is_terminated():
                    m.fill_next_token_bitmask(mask, i * n + j)
                if walked:
                    own.rollback(walked)
        return mask

    def accept(self, req: Req, tok: int) -> FinishReason | None:
        """Advance `req`'s grammar by its new output token `tok` (already appended to output_ids). Returns
        why the request ends: "stop" once the grammar is complete, a 500 if `tok` broke it; else None."""
        state = self.states.get(req.rid)
        if state is None or state.matcher is None:
            return None          # free, not yet active (reasoning), or rebuilt lazily from output_ids
        if not state.matcher.accept_token(tok):
            if self._stuck(state.matcher):
                return FinishReason("abort", message=f"the request's {req.params.grammar[0]} allows no token here "
                                    "(not even the end of the output): it matches no complete text", status_code=400)
            return FinishReason("abort", message=f"internal error: token {tok} does not match the request's "
                                "grammar", status_code=500)
        return FinishReason("stop", matched=tok) if state.matcher.is_terminated() else None

    def _stuck(self, matcher: Any) -> bool:
        """True when the matcher allows no token at all (a grammar such as `root ::= root`)."""
        row = torch.full((1, self.width), -1, dtype=torch.int32)
        matcher.fill_next_token_bitmask(row, 0)
        return not bool(row.any())

    def _matcher(self, req: Req) -> Any:
        """The request's matcher, built on first use by replaying the output after the start token; None
        while the grammar is not active yet (no `grammar_start_id` in the output)."""
        state = self.states.get(req.rid)
        if state is None:
            return None
        if state.matcher is None:
            out = req.output_ids
            if state.start_id is not None:
                if state.start_id not in out:
                    return None
                out = out[out.index(state.start_id) + 1:]
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(state.compiled)
            for t in out:
                if not state.matcher.accept_token(t):
                    raise RuntimeError(f"replaying request {req.rid}: token {t} does not match its grammar")
        return state.matcher

    # --- lifetime --------------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Forget `req` (finished or aborted): its matcher and any compile it waits for."""
        self.states.pop(req.rid, None)
        self.waiting.pop(req.rid, None)

    def release_matcher(self, req: Req) -> None:
        """Drop `req`'s matcher (retraction); it is rebuilt from the output when the request runs again."""
        state = self.states.get(req.rid)
        if state is not None:
            state.matcher = None

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def create_grammar_manager(backend: str, tokenizer_dir: str, vocab_size: int, stop_ids: list[int],
                           synchronous: bool = False) -> GrammarManager:
    """The manager for `--grammar-backend`, reading `tokenizer.json` from `tokenizer_dir` (xgrammar only; without
    one, constrained requests are refused: the server always has one, bare test checkpoints may not)."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if backend == "none" or not path.is_file():
        return GrammarManager(backend, None, vocab_size, stop_ids)
    import tokenizers

    return GrammarManager(backend, tokenizers.Tokenizer.from_file(str(path)), vocab_size, stop_ids, synchronous)


def _make_compiler(tokenizer: tokenizers.Tokenizer, vocab_size: int, stop_ids: list[int]) -> Any:
    import xgrammar as xgr

    return xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_ids), max_threads=COMPILE_THREADS,
                               cache_enabled=False)


def _compile(compiler: Future, kind: str, text: str) -> Any:
    return compiler.result().compile_grammar(parse_grammar(kind, text))


def _walk(state: GrammarState, own, path: list[int]):
    """Advance a matcher along the drafts `path` from `own` (None: not active yet, it starts after the start
    token). Returns (the matcher, tokens `own` took, whether the grammar took every draft)."""
    m, walked = own, 0
    for d in path:
        if m is None:
            if d == state.start_id:
                import xgrammar as xgr

                m = xgr.GrammarMatcher(state.compiled)
            continue
        if m.is_terminated() or not m.accept_token(d):
            return m, walked, False
        walked += m is own
    return m, walked, True
