"""What both engines share: the stats and output of a call, the prompts as rows, per-row
bookkeeping and the prompt's lead-in (the sampler and padding are in
:mod:`spec_ext.drafters.base`, shared with the drafters)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from spec_ext.drafters import check_finite, pad_rows
from spec_ext.models import forward


@dataclass
class SourceCounts:
    """One source's share of a call: the rounds (row, verification) it drafted, its drafts and
    how many were accepted, and its rounds per row."""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    row_rounds: list[int] = field(default_factory=list)


@dataclass
class Stats:
    """Counters of one generate call. ``rounds`` counts (row, verification) pairs; the
    ``row_*`` lists hold counts per row of the batch; ``by_source`` the rounds each source
    drafted (:class:`~spec_ext.policies.Source` names: "model", "text", "cache"), from which
    ``matched`` / ``text_drafted`` / ``text_accepted`` (the rows' text, own or from a
    :class:`~spec_ext.policies.SuffixCache`) and ``cache_matched`` / ``cache_drafted`` /
    ``cache_accepted`` (the cache's alone) are read."""
    target_calls: int = 0
    draft_calls: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    discarded: int = 0  # drafts thrown away unverified (parallel methods draft ahead)
    wall_time: float = 0.0
    processing_time: float = 0.0  # in the logits processors and the grammar (spec_ext.processing)
    tokenizer_mode: str = ""  # a draft of another tokenizer: "tli" or "slem" (what ran)
    gamma: int | None = None  # the parallel engine: the drafts per target forward it ran with
    accepted_lengths: list[int] = field(default_factory=list, repr=False)
    draft_lengths: list[int] = field(default_factory=list, repr=False)
    row_rounds: list[int] = field(default_factory=list, repr=False)
    row_drafted: list[int] = field(default_factory=list, repr=False)
    row_accepted: list[int] = field(default_factory=list, repr=False)
    by_source: dict[str, SourceCounts] = field(default_factory=dict, repr=False)

    def _of(self, *names: str) -> list[SourceCounts]:
        return [self.by_source[n] for n in names if n in self.by_source]

    def _rows(self, *names: str) -> list[int]:
        out = [0] * len(self.row_rounds)
        for counts in self._of(*names):
            out = [a + b for a, b in zip(out, counts.row_rounds)]
        return out

    @property
    def matched(self) -> int:
        return sum(c.rounds for c in self._of("text", "cache"))

    @property
    def text_drafted(self) -> int:
        return sum(c.drafted for c in self._of("text", "cache"))

    @property
    def text_accepted(self) -> int:
        return sum(c.accepted for c in self._of("text", "cache"))

    @property
    def cache_matched(self) -> int:
        return sum(c.rounds for c in self._of("cache"))

    @property
    def cache_drafted(self) -> int:
        return sum(c.drafted for c in self._of("cache"))

    @property
    def cache_accepted(self) -> int:
        return sum(c.accepted for c in self._of("cache"))

    @property
    def row_matched(self) -> list[int]:
        return self._rows("text", "cache")

    @property
    def row_cache_matched(self) -> list[int]:
        return self._rows("cache")

    @property
    def rollback(self) -> int:
        """Drafts thrown away: verified and rejected, plus (parallel methods) unverified ones."""
        return self.drafted - self.accepted + self.discarded

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per row per target call."""
        return self.accepted / max(1, self.rounds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(1e-9, self.wall_time)

    def count(self, r: int, source: str, drafted: int, accepted: int) -> None:
        """Row ``r``'s round, drafted by ``source``."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_lengths.append(accepted)
        self.draft_lengths.append(drafted)
        self.row_rounds[r] += 1
        self.row_drafted[r] += drafted
        self.row_accepted[r] += accepted
        counts = self.by_source.get(source)
        if counts is None:
            counts = self.by_source[source] = SourceCounts(row_rounds=[0] * len(self.row_rounds))
        counts.rounds += 1
        counts.drafted += drafted
        counts.accepted += accepted
        counts.row_rounds[r] += 1

    def as_dict(self) -> dict:
        return dict(target_calls=self.target_calls, draft_calls=self.draft_calls, rounds=self.rounds,
                    drafted=self.drafted, accepted=self.accepted, rollback=self.rollback,
                    mean_accepted=round(self.mean_accepted, 4), acceptance_rate=round(self.acceptance_rate, 4),
                    discarded=self.discarded, new_tokens=self.new_tokens, wall_time=round(self.wall_time, 4),
                    processing_time=round(self.processing_time, 4), tokenizer_mode=self.tokenizer_mode,
                    tokens_per_s=round(self.tokens_per_s, 2), matched=self.matched,
                    text_drafted=self.text_drafted, text_accepted=self.text_accepted,
                    cache_matched=self.cache_matched, cache_drafted=self.cache_drafted,
                    cache_accepted=self.cache_accepted,
                    by_source={name: dict(rounds=c.rounds, drafted=c.drafted, accepted=c.accepted)
                               for name, c in self.by_source.items()},
                    per_row=dict(rounds=self.row_rounds, matched=self.row_matched, drafted=self.row_drafted,
                                 cache_matched=self.row_cache_matched, accepted=self.row_accepted))


@dataclass
class Output:
    sequences: Tensor  # [B, prompt + new], like HF generate
    stats: Stats


def prompt_rows(input_ids, attention_mask, vocab_size: int | None = None) -> list[list[int]]:
    """The prompts as token-id lists (the positions ``attention_mask`` masks removed: left
    padding, or right padding, whose rows then go on from their own text), each id checked to
    be an int in [0, ``vocab_size``) when given (the target's embedding would raise an
    IndexError from deep inside the forward)."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, L], got shape {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids: expected integer token ids, got a tensor of {input_ids.dtype}")
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected a tensor of shape {tuple(input_ids.shape)}, got "
                                 f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask!r}")
            mask = attention_mask.cpu().bool()
            if mask.shape[1] and bool((~mask[:, -1] & mask.any(1)).any()):  # a row ends in padding
                _warn_right_padding()
            rows = [ids[m].tolist() for ids, m in zip(input_ids.cpu(), mask)]
        else:
            rows = input_ids.tolist()
    else:
        try:
            rows = [list(r) for r in input_ids]
        except TypeError:
            raise TypeError(f"input_ids: expected a [B, L] tensor or a list of token-id lists, got "
                            f"{type(input_ids).__name__}") from None
        for b, r in enumerate(rows):
            bad = next((t for t in r if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
            if bad is not None:
                raise TypeError(f"input_ids: prompt {b} holds {bad!r} ({type(bad).__name__}); token ids are ints "
                                f"(tokenize the text first)")
        rows = [[int(t) for t in r] for r in rows]
    if not rows:
        raise ValueError("input_ids: the batch is empty")
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"input_ids: prompt {b} is empty")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in r):
            bad = next(t for t in r if not 0 <= t < vocab_size)
            raise ValueError(f"input_ids: prompt {b} has token id {bad}, outside the target's vocabulary of "
                             f"{vocab_size} ids (0..{vocab_size - 1}): was it made by another model's tokenizer?")
    return rows


_WARNED: set[str] = set()


def _warn_right_padding() -> None:
    """Once per process: a row whose last positions are masked (right padding)."""
    if "right padding" not in _WARNED:
        _WARNED.add("right padding")
        warnings.warn("attention_mask: right padding (a masked position after the prompt's tokens). spec_ext "
                      "continues each row's own text, as if it were left-padded; HF's generate continues after the "
                      "pads. Pad on the left (tokenizer padding_side='left') to get what HF computes.", stacklevel=4)


class Rows:
    """Per-row output bookkeeping shared by the serial and the parallel engines: every
    row's tokens so far (``seqs``), its new tokens, the rows still going (``active``) and
    the stats."""

    stop = None  # spec_ext.processing.stop.StopStrings: rows also end where a stop string completes

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, eos: set[int], streamer=None):
        self.seqs = [list(p) for p in prompts]
        self.new: list[list[int]] = [[] for _ in prompts]
        self.active = list(range(len(prompts)))
        self.max_new, self.eos, self.streamer = max_new_tokens, eos, streamer
        self.stats = Stats(row_rounds=[0] * len(prompts), row_drafted=[0] * len(prompts),
                           row_accepted=[0] * len(prompts))

    def emit(self, r: int, tokens: list[int], num_drafted: int, num_accepted: int, source: str = "model") -> bool:
        """Append row ``r``'s tokens of one verification, cut at max_new_tokens and at EOS,
        and count the round (``source``: what drafted it); True while the row goes on."""
        emitted = tokens[:self.max_new - len(self.new[r])]
        for n, tok in enumerate(emitted):
            if tok in self.eos:
                emitted = emitted[:n + 1]
                break
        stopped = self.stop is not None and (cut := self.stop.cut(r, self.new[r], emitted)) is not None
        if stopped:
            emitted = emitted[:cut]
        self.seqs[r] += emitted
        self.new[r] += emitted
        self.stats.count(r, source, num_drafted, num_accepted)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(emitted))
        return len(self.new[r]) < self.max_new and not (emitted and emitted[-1] in self.eos) and not stopped

    def finish(self) -> Stats:
        self.stats.new_tokens = sum(map(len, self.new))
        return self.stats


PROMPT_CHUNK = 1024  # the most prompt tokens a row feeds the target in one forward of the first round


def lead_in(model, cache, rows: Sequence[Sequence[int]], layers: tuple[int, ...] | None = None,
            chunk: int | None = None) -> tuple[list[int], Tensor | None, int]:
    """Before a call's first forward over its prompts: feed each row's tokens but its last
    ``chunk`` (:data:`PROMPT_CHUNK` when None) in forwards of at most ``chunk`` tokens a row,
    so the first forward reads at most ``chunk`` prompt tokens a row; each forward's logits
    at its rows' last tokens are checked and dropped. Returns each row's count fed (all 0 where no
    prompt is longer than ``chunk``: nothing runs), with ``layers`` their features
    [B, max(fed), F] (row b's first ``fed[b]``), and the forwards run."""
    chunk = PROMPT_CHUNK if chunk is None else chunk
    fed = [max(0, len(r) - chunk) for r in rows]
    kept, forwards = [], 0
    for start in range(0, max(fed), chunk):
        part = [r[start:min(start + chunk, n)] for r, n in zip(rows, fed)]
        ids = pad_rows(part, 0, cache.buffer.device)
        last = torch.tensor([[max(len(p) - 1, 0)] for p in part], device=ids.device)
        out = forward(model, ids, cache, cache.lengths[:, None] + torch.arange(ids.shape[1], device=ids.device),
                      logits_at=last, **({} if layers is None else dict(layers=layers)))
        check_finite(out.logits, "target")
        cache.advance([len(p) for p in part])
        kept.append(out.features)
        forwards += 1
    return fed, torch.cat(kept, 1) if layers is not None and kept else None, forwards
