"""Grammar-constrained output: :class:`Grammar` (what the user passes) and :class:`Matchers`
(one llguidance matcher per row, advanced on committed tokens; the tokens each draft
position may take, walking the drafts depth-first with consume and rollback).

llguidance (PyPI) is the grammar engine: JSON schemas, regular expressions and context-free
grammars (Lark, or llama.cpp's GBNF) compiled against the target's tokenizer.
"""
from __future__ import annotations

import json
import weakref

import torch
from torch import Tensor


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as error:  # pragma: no cover - a dependency of the package
        raise ImportError("grammar: needs the llguidance package (pip install llguidance)") from error
    return llguidance


class Grammar:
    """A grammar the generated text must follow (the prompt is not matched against it).

    Example:
        >>> g = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
        >>> fast.generate(ids, tokenizer=tok, grammar=g)                 # doctest: +SKIP
    """

    def __init__(self, definition: str, kind: str):
        self.definition, self.kind = definition, kind

    def __repr__(self) -> str:
        return f"Grammar.{self.kind}(...)"

    @staticmethod
    def json_schema(schema: dict | str) -> "Grammar":
        """JSON text valid under ``schema`` (a dict or its JSON text)."""
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            return Grammar(_llguidance().LLMatcher.grammar_from_json_schema(schema), "json_schema")
        except ValueError as error:
            raise ValueError(f"grammar: the JSON schema is not valid JSON: {error}") from None

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        """Text matching the regular expression ``pattern`` as a whole (Rust regex syntax)."""
        return Grammar(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")

    @staticmethod
    def ebnf(text: str) -> "Grammar":
        """A context-free grammar in Lark syntax or llama.cpp's GBNF (start rule ``start`` or ``root``)."""
        try:
            return Grammar(_llguidance().grammar_from("ebnf", text), "ebnf")
        except ValueError as error:
            raise ValueError(f"grammar: {error}") from None


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...]):
    """llguidance's view of ``tokenizer`` with ``vocab`` logits columns (about a second to
    build for a large vocabulary: kept per tokenizer object)."""
    llg = _llguidance()
    cache = _TOKENIZERS.setdefault(tokenizer, {})
    if (vocab, eos) not in cache:
        try:
            cache[vocab, eos] = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos))
        except ValueError as error:
            raise ValueError(f"tokenizer: llguidance cannot read it ({error}); a grammar needs a fast "
                             f"(tokenizers-backed) tokenizer") from None
    return cache[vocab, eos]


class Matchers:
    """One matcher per row of a generate call (``grammars[b]`` None: row b is free)."""

    def __init__(self, grammars: list[Grammar], tokenizer, vocab: int, eos: list[int]):
        if not eos:
            raise ValueError("grammar: needs an EOS id (eos_token_id) to end the text when the grammar completes")
        self.vocab = vocab
        self.tokenizer = _ll_tokenizer(tokenizer, vocab, tuple(eos))
        llg = _llguidance()
        compiled = {id(None): None}
        for g in grammars:
            if id(g) not in compiled:
                matcher = llg.LLMatcher(self.tokenizer, g.definition, log_level=0)
                if matcher.is_error():
                    raise ValueError(f"grammar: {g!r} does not compile: {matcher.get_error()}")
                compiled[id(g)] = matcher
        self.prototypes = [compiled[id(g)] for g in grammars]

    def start(self, rows: int) -> None:
        self.matchers = [None if p is None else p.deep_copy() for p in self.prototypes]
        # per row: the draft tokens its matcher holds past the committed text (kept between
        # calls, so a chain's next draft step consumes one token), and the masks computed for
        # paths since the last commit (the verification reuses the draft steps')
        self.consumed: list[list[int]] = [[] for _ in range(rows)]
        self.masks: list[dict] = [{} for _ in range(rows)]

    def _back_to_committed(self, b: int) -> None:
        if self.consumed[b]:
            self.matchers[b].rollback(len(self.consumed[b]))
            self.consumed[b] = []

    def commit(self, committed: list[list[int]], eos: set[int]) -> None:
        """Each row kept ``committed[b]`` (up to its first EOS, not consumed: the row ends there)."""
        for b, (matcher, tokens) in enumerate(zip(self.matchers, committed)):
            if matcher is None:
                continue
            self._back_to_committed(b)
            self.masks[b] = {}
            end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
            if not matcher.consume_tokens(tokens[:end]):
                raise ValueError(f"grammar: row {b}: {matcher.get_error()}")

    def keep_rows(self, rows: list[int]) -> None:
        self.matchers = [self.matchers[i] for i in rows]
        self.consumed = [self.consumed[i] for i in rows]
        self.masks = [self.masks[i] for i in rows]

    def bitmask(self, paths: list[list[list[int] | None]]) -> Tensor:
        """[B,T,ceil(V/32)] int32 (CPU): the tokens each position may take after its path
        (``paths[b][t]``; None: a position not to mask; such positions, and those whose path
        leaves the grammar, allow every token: the target never reaches them). Each row's
        paths are walked in lexicographic order, a trie's depth-first order, from where the
        last walk stopped: a shared prefix is consumed once, a mask computed once per commit."""
        fill = _llguidance().torch.fill_next_token_bitmask
        B, T = len(paths), len(paths[0])
        bits = torch.full((B * T, (self.vocab + 31) // 32), -1, dtype=torch.int32)
        for b, (matcher, row) in enumerate(zip(self.matchers, paths)):
            if matcher is None:
                continue
            if matcher.is_error():
                raise ValueError(f"grammar: row {b}: {matcher.get_error()}")
            consumed, masks = self.consumed[b], self.masks[b]
            try:
                for path, t in sorted((p, t) for t, p in enumerate(row) if p is not None):
                    key = tuple(path)
                    if key in masks:
                        bits[b * T + t] = masks[key]
                        continue
                    common = 0
                    while common < min(len(consumed), len(path)) and consumed[common] == path[common]:
                        common += 1
                    if len(consumed) > common:
                        matcher.rollback(len(consumed) - common)
                        del consumed[common:]
                    if len(path) > common:
                        consumed += path[common:common + matcher.try_consume_tokens(path[common:])]
                    if len(consumed) == len(path):
                        fill(matcher, bits, b * T + t)
                        masks[key] = bits[b * T + t].clone()
            except BaseException:
                self._back_to_committed(b)
                raise
        return bits.view(B, T, -1)
