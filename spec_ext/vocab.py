"""The map between two tokenizers' vocabularies, by the exact bytes of each token.

A drafter with another tokenizer than the target's (:mod:`spec_ext.drafters.other_tokenizer`)
proposes, under token-level intersection (Timor et al., arXiv 2502.05202), only the draft
tokens whose bytes are those of a target token. What a token's bytes are depends on how its
tokenizer writes them:

* byte-level BPE (GPT-2, Llama-3, Qwen): each character of the token stands for one byte
  through the ``ByteLevel`` table (``Ġ`` is the space, ``Ċ`` the newline);
* SentencePiece style (``Metaspace`` or a ``▁`` replace): ``▁`` is the space, and with byte
  fallback ``<0x41>`` is the byte 0x41;
* anything else (word-level, WordPiece): the token's UTF-8 text (WordPiece's ``##`` dropped);
* added and special tokens are matched by their content string (``</s>`` with ``</s>``), never
  with an ordinary token of the same bytes.

Two tokens of one vocabulary may have the same bytes (``<0x41>`` and ``A``): the map is made
one-to-one by keeping one of them (the ordinary token over the byte-fallback one, then the
lowest id), so the draft's law pushed onto the target's ids is its law on the kept tokens.

Example:
    >>> m = vocab_map(draft_tokenizer, target_tokenizer)                      # doctest: +SKIP
    >>> m.draft_to_target[m.target_to_draft[t]] == t                          # doctest: +SKIP
    >>> m.share_by_frequency(target_tokenizer(text).input_ids)                # doctest: +SKIP
    0.93
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import re
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PrefixIndex", "VocabMap", "prefix_index", "token_keys", "vocab_map"]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The ``ByteLevel`` table, character -> byte (GPT-2's: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _components(spec: dict | None) -> list[dict]:
    """A pre-tokenizer's or decoder's JSON with its ``Sequence`` flattened."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        parts = spec.get("pretokenizers") or spec.get("decoders") or []
        return [c for part in parts for c in _components(part)]
    return [spec]


def _style(spec: dict) -> tuple[str, bool]:
    """("byte_level" | "metaspace" | "wordpiece" | "plain", byte fallback) of a tokenizer's JSON."""
    parts = _components(spec.get("pre_tokenizer")) + _components(spec.get("decoder"))
    kinds = {p.get("type") for p in parts}
    model = spec.get("model") or {}
    fallback = bool(model.get("byte_fallback")) or "ByteFallback" in kinds
    if "ByteLevel" in kinds:
        return "byte_level", fallback
    replaces = [p for p in parts if p.get("type") == "Replace"]
    if "Metaspace" in kinds or any("▁" in json.dumps(p, ensure_ascii=False) for p in replaces):
        return "metaspace", fallback
    if model.get("type") == "WordPiece" or "WordPiece" in kinds:
        return "wordpiece", fallback
    return "plain", fallback


def _fast(tokenizer, name: str):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{name}: a fast tokenizer (with a backend_tokenizer from the tokenizers library) is needed "
                         f"to map vocabularies by bytes, got {type(tokenizer).__name__}")
    return backend


def token_keys(tokenizer, name: str = "tokenizer") -> list[tuple[str, bytes | str, bool] | None]:
    """Per id (``len(tokenizer)`` of them): ``("bytes", b, fallback)`` for an ordinary token
    (``fallback``: written as a byte-fallback ``<0xNN>``), ``("added", content, False)`` for
    an added or special token, None for a token whose bytes cannot be read (an id the
    vocabulary skips, a byte-level token with a character outside the table)."""
    backend = _fast(tokenizer, name)
    style, fallback = _style(json.loads(backend.to_str()))
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    table = _byte_level_decoder()
    keys: list[tuple[str, bytes | str, bool] | None] = []
    for i in range(len(tokenizer)):
        if i in added:
            keys.append(("added", added[i], False))
            continue
        token = backend.id_to_token(i)
        if token is None:
            keys.append(None)
            continue
        byte = _BYTE_FALLBACK.match(token) if fallback else None
        if byte is not None:
            keys.append(("bytes", bytes([int(byte.group(1), 16)]), True))
        elif style == "byte_level":
            keys.append(("bytes", bytes(table[c] for c in token), False) if all(c in table for c in token) else None)
        elif style == "metaspace":
            keys.append(("bytes", token.replace("▁", " ").encode(), False))
        elif style == "wordpiece":
            keys.append(("bytes", token.removeprefix("##").encode(), False))
        else:
            keys.append(("bytes", token.encode(), False))
    return keys


@dataclass(frozen=True)
class VocabMap:
    """A one-to-one map between the shared tokens of a draft and a target vocabulary.

    ``draft_to_target`` [Vd] int64: the target id of each draft id, -1 where unshared;
    ``target_to_draft`` [Vt] int64: the inverse, -1 where unshared. Vd and Vt are the
    tokenizers' sizes, or the models' (:meth:`padded`) when their embedding tables are larger.
    """
    draft_to_target: Tensor
    target_to_draft: Tensor

    @property
    def shared(self) -> int:
        """How many tokens the two vocabularies share."""
        return int((self.draft_to_target >= 0).sum())

    def share_by_frequency(self, target_ids) -> float:
        """The share of the target's tokens the draft vocabulary covers, each counted as often
        as it occurs in ``target_ids`` (a tensor or nested lists of target ids: some of the
        target's own text); 0 for no ids."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten()
        ids = ids[(ids >= 0) & (ids < len(self.target_to_draft))]
        return float((self.target_to_draft[ids] >= 0).float().mean()) if len(ids) else 0.0

    def padded(self, draft_size: int, target_size: int) -> "VocabMap":
        """The map for models whose vocabularies hold ``draft_size`` and ``target_size`` rows
        (ids past a tokenizer's size are unshared; ids past a model's are dropped)."""
        def fit(t: Tensor, size: int, other: int) -> Tensor:
            t = torch.cat([t, t.new_full((max(0, size - len(t)),), -1)])[:size]
            return t.masked_fill(t >= other, -1)
        return VocabMap(fit(self.draft_to_target, draft_size, target_size),
                        fit(self.target_to_draft, target_size, draft_size))


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> (its size, its hash)


def fingerprint(tokenizer, name: str) -> str:
    """A hash of everything that decides ``token_keys``: the tokenizer's JSON (vocabulary,
    added tokens, pre-tokenizer, decoder) and its size; kept per tokenizer object while its
    size stays (serialising a large vocabulary takes tens of milliseconds)."""
    backend = _fast(tokenizer, name)
    kept = _FINGERPRINTS.get(tokenizer)
    if kept is not None and kept[0] == len(tokenizer):
        return kept[1]
    text = backend.to_str() + f"|{len(tokenizer)}"
    digest = hashlib.sha256(text.encode()).hexdigest()
    _FINGERPRINTS[tokenizer] = (len(tokenizer), digest)
    return digest


_MAPS: dict[tuple[str, str], VocabMap] = {}  # (draft hash, target hash) -> map; a few pairs per process


def vocab_map(draft_tokenizer, target_tokenizer) -> VocabMap:
    """The :class:`VocabMap` of a draft tokenizer and a target tokenizer (computed once per
    pair of tokenizers, cached by a hash of both). ``ValueError`` naming the argument when
    one is not a fast tokenizer."""
    key = (fingerprint(draft_tokenizer, "draft_tokenizer"), fingerprint(target_tokenizer, "target_tokenizer"))
    if key not in _MAPS:
        if len(_MAPS) >= 16:
            _MAPS.pop(next(iter(_MAPS)))
        _MAPS[key] = _build(draft_tokenizer, target_tokenizer)
    return _MAPS[key]


def _build(draft_tokenizer, target_tokenizer) -> VocabMap:
    draft_keys = token_keys(draft_tokenizer, "draft_tokenizer")
    target_keys = token_keys(target_tokenizer, "target_tokenizer")

    def index(keys) -> dict:
        """key -> the id kept for it: an ordinary token over a byte-fallback one, then the lowest id."""
        best: dict = {}
        for i, key in enumerate(keys):
            if key is None:
                continue
            kind, value, is_fallback = key
            kept = best.get((kind, value))
            if kept is None or (keys[kept][2] and not is_fallback):
                best[(kind, value)] = i
        return best

    draft_index, target_index = index(draft_keys), index(target_keys)
    d2t = torch.full((len(draft_keys),), -1, dtype=torch.int64)
    t2d = torch.full((len(target_keys),), -1, dtype=torch.int64)
    for key, d in draft_index.items():
        t = target_index.get(key)
        if t is not None:
            d2t[d], t2d[t] = t, d
    return VocabMap(d2t, t2d)


@dataclass(frozen=True)
class PrefixIndex:
    """One vocabulary's ordinary tokens by their bytes, to find every token whose bytes begin
    with given bytes (token healing: the draft's next token must spell the text its context
    left out). ``token_bytes[i]``: token i's bytes (None for added and special tokens, and
    for ids whose bytes cannot be read); ``rank`` [V] int64: each id's place in the
    tokens sorted by bytes (``len(token_bytes)`` for the None ones, which no range holds);
    ``spelled``: the tokens' bytes, joined, are the text (byte-level BPE, SentencePiece style);
    False where the decoder writes the spaces between tokens (word-level, WordPiece)."""
    token_bytes: tuple[bytes | None, ...]
    rank: Tensor
    spelled: bool
    _sorted: tuple[bytes, ...]

    def bounds(self, prefix: bytes) -> tuple[int, int]:
        """(lo, hi): the ranks of the tokens whose bytes begin with ``prefix`` are lo..hi-1."""
        lo = bisect.bisect_left(self._sorted, prefix)
        trimmed = prefix.rstrip(b"\xff")  # every bytes that begin with prefix sort below its successor
        if not trimmed:
            return lo, len(self._sorted)
        return lo, bisect.bisect_left(self._sorted, trimmed[:-1] + bytes([trimmed[-1] + 1]), lo)


_PREFIXES: dict[str, PrefixIndex] = {}  # tokenizer hash -> index; a few per process


def prefix_index(tokenizer, name: str = "tokenizer") -> PrefixIndex:
    """The :class:`PrefixIndex` of ``tokenizer``'s vocabulary (computed once per tokenizer,
    cached by its hash)."""
    key = fingerprint(tokenizer, name)
    if key not in _PREFIXES:
        if len(_PREFIXES) >= 16:
            _PREFIXES.pop(next(iter(_PREFIXES)))
        token_bytes = tuple(k[1] if k is not None and k[0] == "bytes" else None for k in token_keys(tokenizer, name))
        order = sorted((b, i) for i, b in enumerate(token_bytes) if b is not None)
        rank = torch.full((len(token_bytes),), len(token_bytes), dtype=torch.int64)
        for r, (_, i) in enumerate(order):
            rank[i] = r
        style, _ = _style(json.loads(_fast(tokenizer, name).to_str()))
        _PREFIXES[key] = PrefixIndex(token_bytes, rank, style in ("byte_level", "metaspace"),
                                     tuple(b for b, _ in order))
    return _PREFIXES[key]
