"""Structured outputs in the scheduler: grammars compiled once per constraint, one matcher per request.

The scheduler owns every request's tokens, so it owns its grammar state too (as vLLM V1 does); the
executor only applies the packed next-token masks the plan carries. Here:

* `GrammarCompilerPool` compiles each distinct constraint once per tokenizer (xgrammar), on a small
  thread pool: the request that asked awaits its own compile (the gRPC handler, before it submits),
  so nothing else waits for it. A constraint that does not compile raises `InvalidRequest` naming
  `structured_outputs` and xgrammar's reason. Compiled grammars (and refusals) are kept in an LRU.
* `RequestGrammar` is one request's matcher: advanced with each accepted token
  (`Scheduler.process_output`), able to `rollback(n)` tokens taken back (speculative decoding),
  and filling its row of the step's bitmask when the request samples.

JSON schemas and regexes go through xgrammar's converters to EBNF first, where character classes
are corrected (`_CLASS_FIXES`): xgrammar 0.2.9 lets a length-bounded JSON string hold raw control
characters, which JSON forbids, and lets any class reaching U+10FFFF hold UTF-16 surrogates, which
UTF-8 cannot. The EBNF is then compiled as a grammar.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from pagedserve.common.structured_outputs import StructuredOutputs
from pagedserve.common.validation import InvalidRequest

log = structlog.get_logger()

# Distinct constraints kept compiled (each holds a token mask cache: ~vocab/8 bytes per state).
GRAMMAR_CACHE_SIZE = 256
COMPILE_THREADS = 2
# Character classes of xgrammar's EBNF that admit what UTF-8 text cannot hold, and what replaces
# them: a length-bounded JSON string's admits control characters (JSON forbids them raw); every
# class that reaches U+10FFFF admits the surrogates U+D800-U+DFFF, whose 3-byte forms are not UTF-8
# (the output would decode to U+FFFD, and a maxLength would count three characters).
_CLASS_FIXES = (
    ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'),
    ('[^\\0-\\x1f\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n\\uD800-\\uDFFF]'),
    ("[\\0-\\U0010ffff]", "[\\0-\\uD7FF\\uE000-\\U0010ffff]"),
)


def _utf8_only(ebnf: str) -> str:
    for loose, strict in _CLASS_FIXES:
        ebnf = ebnf.replace(loose, strict)
    return ebnf


def bitmask_words(vocab_size: int) -> int:
    """int32 words per mask row (xgrammar's packing: 32 tokens a word)."""
    return (vocab_size + 31) // 32


def constraint_ebnf(spec: StructuredOutputs) -> str:
    """The constraint as an EBNF grammar for xgrammar (a regex compiles as one)."""
    import xgrammar as xgr

    if spec.kind == "choice":
        # JSON string literals are xgrammar EBNF literals (\", \\, \n, \uXXXX).
        import json

        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value)
    if spec.kind == "regex":
        return _utf8_only(str(xgr.Grammar.from_regex(spec.value)))
    if spec.kind == "grammar":
        return spec.value
    schema = spec.value if spec.kind == "json" else '{"type": "object"}'
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=not spec.disable_any_whitespace))
    return _utf8_only(ebnf)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location ("[12:00:00] /project/cpp/x.cc:12: ")."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if first.startswith("[") and ": " in first:
        first = first.split(": ", 1)[1]
        if ".cc:" in first.split(" ", 1)[0]:
            first = first.split(": ", 1)[-1]
    return first


@dataclass
class CompileStats:
    """Counters for the metrics and the benchmarks."""

    compiled: int = 0
    cache_hits: int = 0
    refused: int = 0
    compile_seconds: float = 0.0


class GrammarCompilerPool:
    """Compiles constraints for one tokenizer and vocabulary (`vocab_size`: the model's logits
    width, which may exceed the tokenizer's; `stop_token_ids`: EOS, allowed where a grammar ends).

    xgrammar is given the tokenizer's tokens only (`grammar_vocab_size`), not the logits' padding
    rows past them: it would take each of those ids for a special token, and it scans its special
    tokens linearly on every accepted token and every mask (xgrammar 0.2.9; a 512-token tokenizer
    under a 128,256-wide head: 25 us per accepted token instead of 1.2, 6 us per mask row instead
    of 1.2). Those tokens are never allowed either way: the masks' columns past the tokenizer are
    zero (`widen_bitmask`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.grammar_vocab_size = min(
            vocab_size, max([len(tokenizer), *(i + 1 for i in self.stop_token_ids)])
        )
        self.stats = CompileStats()
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._cache: OrderedDict[StructuredOutputs, concurrent.futures.Future] = OrderedDict()

    def _get_compiler(self) -> Any:
        """xgrammar's compiler, made on first use (the tokenizer's info takes a while for a large
        vocabulary), on a compile thread."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.grammar_vocab_size,
                    stop_token_ids=list(self.stop_token_ids),
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
            return self._compiler

    def _compile(self, spec: StructuredOutputs) -> Any:
        start = time.perf_counter()
        compiler = self._get_compiler()
        try:
            compiled = compiler.compile_grammar(constraint_ebnf(spec))
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) with its reason
            self.stats.refused += 1
            raise InvalidRequest(
                "structured_outputs", f"{spec.kind}: does not compile: {_reason(exc)}"
            ) from None
        seconds = time.perf_counter() - start
        self.stats.compiled += 1
        self.stats.compile_seconds += seconds
        log.info("grammar compiled", kind=spec.kind, seconds=round(seconds, 4))
        return compiled

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        """The compile of `spec`, started now or earlier (one per distinct constraint)."""
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            self.stats.cache_hits += 1
            return future
        future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    async def grammar(self, spec: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher for `spec`, once it is compiled (the caller alone waits for it)."""
        compiled = await asyncio.wrap_future(self.submit(spec))
        return RequestGrammar.new(compiled, self.vocab_size, self.stop_token_ids)

    def grammar_blocking(self, spec: StructuredOutputs) -> RequestGrammar:
        return RequestGrammar.new(self.submit(spec).result(), self.vocab_size, self.stop_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class RequestGrammar:
    """One request's matcher. `num_accepted` counts the tokens it has accepted (its outputs).
    `vocab_size`: the masks' width (the model's logits); `grammar_vocab_size`: the matcher's
    (the tokenizer's tokens, `GrammarCompilerPool`), which `fill_bitmask` writes."""

    matcher: Any
    vocab_size: int
    grammar_vocab_size: int
    stop_token_ids: tuple[int, ...] = ()
    num_accepted: int = 0
    failed: bool = field(default=False)
    # matcher.is_terminated(), kept here: asked for every token of every constrained request (the
    # engine, the late masks), and a call into xgrammar costs as much as the rest of that check.
    terminated: bool = field(default=False)

    @classmethod
    def new(cls, compiled: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()) -> RequestGrammar:
        import xgrammar as xgr

        grammar_vocab = compiled.tokenizer_info.vocab_size
        return cls(xgr.GrammarMatcher(compiled), vocab_size, grammar_vocab, tuple(stop_token_ids))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and the stop token that ends it was accepted."""
        return self.terminated

    def accept(self, token_id: int) -> bool:
        """Advances with a sampled token; False if the grammar does not allow it (the mask should
        have made that impossible: the request is then ended)."""
        if self.failed or self.terminated:
            return False
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
            # A matcher (terminate_without_stop_token off) terminates by accepting a stop token,
            # and only where its grammar may end: accept_token refuses it elsewhere.
            self.terminated = token_id in self.stop_token_ids
        else:
            self.failed = True
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if num_tokens > self.num_accepted:
            raise ValueError(f"rollback of {num_tokens} tokens, only {self.num_accepted} accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self.terminated = False  # a stop token is the last one accepted: it was taken back

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into row `row` of an int32 [rows, words] array, words
        being bitmask_words(grammar_vocab_size) (`widen_bitmask` pads it to the model's width)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allowed_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Speculative decoding: the longest prefix of `token_ids` the grammar allows after the
        accepted tokens, short of a token that would end it (the token after the proposals is
        sampled, so it must be one the grammar can take); the matcher is left as it was."""
        if self.failed or self.terminated:
            return []
        allowed = 0
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                break
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                break
            allowed += 1
        if allowed:
            self.matcher.rollback(allowed)
        return list(token_ids[:allowed])


def widen_bitmask(bitmask: np.ndarray, grammar_vocab_size: int, vocab_size: int) -> np.ndarray:
    """Masks filled over the matchers' vocabulary (`grammar_vocab_size` tokens) as rows of the
    model's width (`vocab_size`): the tokens past the tokenizer's are never allowed (xgrammar
    sets the bits of its last word past its vocabulary: they are cleared)."""
    if grammar_vocab_size == vocab_size:
        return bitmask
    filled, words = bitmask.shape[1], bitmask_words(vocab_size)
    wide = bitmask
    if filled < words:
        wide = np.zeros((len(bitmask), words), dtype=np.int32)
        wide[:, :filled] = bitmask
    if grammar_vocab_size % 32:
        wide[:, filled - 1] &= np.int32((1 << (grammar_vocab_size % 32)) - 1)
    return wide


def share_rows(bitmask: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Each distinct row of `bitmask` once, and for each row the index of its own among them
    (StepPlan.mask_rows); `(bitmask, [])` where no two rows are the same. Requests in the same
    grammar state have the same mask (W1-JSON: 3 to 28 distinct among 512, most of them within its
    long string), and a row is 16 KB at a 128,256-token vocabulary: sent once each, a late-masks
    message is tens of KB instead of 8.2 MB, whose copies and gRPC send cost the scheduler 24 ms
    of CPU (0.3 ms for 20 rows), against 1.7 ms for this (512 rows of 4,008 words; 2-core CPU).
    Rows are grouped by a fingerprint (a dot product with fixed random words), then the grouping
    is checked exactly: if two different rows share a fingerprint (it is no hash of their every
    bit), none is shared."""
    if len(bitmask) < 2:
        return bitmask, []
    words = bitmask.view(np.uint64 if bitmask.shape[1] % 2 == 0 else np.uint32)
    first: dict[int, int] = {}
    fingerprints = np.einsum("ij,j->i", words, _fingerprint_weights(words.shape[1], words.dtype))
    rows = [first.setdefault(f, len(first)) for f in fingerprints.tolist()]
    if len(first) == len(bitmask):
        return bitmask, []
    distinct = bitmask[np.unique(rows, return_index=True)[1]]  # each group's first row, in order
    if not np.array_equal(distinct[rows], bitmask):
        return bitmask, []
    return distinct, rows


@functools.cache
def _fingerprint_weights(width: int, dtype: np.dtype) -> np.ndarray:
    return np.random.default_rng(width).integers(0, np.iinfo(dtype).max, width, dtype=dtype, endpoint=True)


def fill_bitmasks(
    grammars: Sequence[RequestGrammar], vocab_size: int, batch: Any = None, share: bool = False
) -> tuple[np.ndarray, list[int]]:
    """The next-token masks of `grammars`, one row each (int32 [len, words of vocab_size]), and
    no row index; `share`: each distinct row once, and each grammar's row index (`share_rows`:
    over the matchers' width, before the rows are widened). `batch`: an xgrammar
    BatchGrammarMatcher, which fills the rows on its own threads (used from 16 rows)."""
    grammar_vocab = grammars[0].grammar_vocab_size
    bitmask = np.empty((len(grammars), bitmask_words(grammar_vocab)), dtype=np.int32)
    if batch is not None and len(grammars) >= 16:
        batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
    else:
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
    bitmask, rows = share_rows(bitmask) if share else (bitmask, [])
    return widen_bitmask(bitmask, grammar_vocab, vocab_size), rows


def fill_bitmasks_along(
    grammars: Sequence[RequestGrammar], proposals: Sequence[Sequence[int]], vocab_size: int
) -> np.ndarray:
    """Speculative decoding: for each grammar, the masks of the next token after its accepted
    tokens and after each of its `proposals` (which it allows: `allowed_prefix`), len(proposals) + 1
    rows each, in order; every matcher is left as it was."""
    grammar_vocab = grammars[0].grammar_vocab_size
    num_rows = sum(len(p) + 1 for p in proposals)
    bitmask = np.empty((num_rows, bitmask_words(grammar_vocab)), dtype=np.int32)
    row = 0
    for grammar, tokens in zip(grammars, proposals, strict=True):
        for position in range(len(tokens) + 1):
            grammar.fill_bitmask(bitmask, row)
            row += 1
            if position < len(tokens):
                assert grammar.matcher.accept_token(tokens[position]), "a proposal outside the grammar"
        if tokens:
            grammar.matcher.rollback(len(tokens))
    return widen_bitmask(bitmask, grammar_vocab, vocab_size)


def batch_matcher() -> Any:
    """An xgrammar BatchGrammarMatcher (its threads fill many rows at once)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads="auto")
