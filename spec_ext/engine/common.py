"""What both engines share: the stats and output of a call, the prompts as rows and per-row
bookkeeping (the sampler, padding and the prefill are in
:mod:`spec_ext.drafters.base`, shared with the drafters)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor



@dataclass
class Stats:
    """Counters of one generate call. ``rounds`` counts (row, verification) pairs;
    ``matched`` the rounds whose drafts came from the row's own text (``NGram``), and
    ``text_drafted`` / ``text_accepted`` their drafts; the ``row_*`` lists hold the same
    counts per row of the batch; ``cache_matched`` / ``cache_drafted`` / ``cache_accepted``
    (and ``row_cache_matched``) the part of those whose drafts came from a
    :class:`~spec_ext.policies.SuffixCache` of earlier requests."""
    target_calls: int = 0
    draft_calls: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    matched: int = 0
    text_drafted: int = 0
    text_accepted: int = 0
    cache_matched: int = 0
    cache_drafted: int = 0
    cache_accepted: int = 0
    new_tokens: int = 0
    discarded: int = 0  # drafts thrown away unverified (parallel methods draft ahead)
    wall_time: float = 0.0
    processing_time: float = 0.0  # in the logits processors and the grammar (spec_ext.processing)
    tokenizer_mode: str = ""  # a draft of another tokenizer: "tli" or "slem" (what ran)
    accepted_lengths: list[int] = field(default_factory=list, repr=False)
    draft_lengths: list[int] = field(default_factory=list, repr=False)
    row_rounds: list[int] = field(default_factory=list, repr=False)
    row_matched: list[int] = field(default_factory=list, repr=False)
    row_cache_matched: list[int] = field(default_factory=list, repr=False)
    row_drafted: list[int] = field(default_factory=list, repr=False)
    row_accepted: list[int] = field(default_factory=list, repr=False)

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
                    per_row=dict(rounds=self.row_rounds, matched=self.row_matched, drafted=self.row_drafted,
                                 cache_matched=self.row_cache_matched,
                                 accepted=self.row_accepted))


@dataclass
class Output:
    sequences: Tensor  # [B, prompt + new], like HF generate
    stats: Stats


def prompt_rows(input_ids, attention_mask, vocab_size: int | None = None) -> list[list[int]]:
    """The prompts as token-id lists (left padding removed with ``attention_mask``), each id
    checked to be in [0, ``vocab_size``) when given (the target's embedding would raise an
    IndexError from deep inside the forward)."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, L], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        else:
            rows = input_ids.tolist()
    else:
        rows = [list(map(int, r)) for r in input_ids]
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
        self.stats = Stats(row_rounds=[0] * len(prompts), row_matched=[0] * len(prompts),
                           row_cache_matched=[0] * len(prompts),
                           row_drafted=[0] * len(prompts), row_accepted=[0] * len(prompts))

    def emit(self, r: int, tokens: list[int], num_drafted: int, num_accepted: int, matched: bool = False,
             cached: bool = False) -> bool:
        """Append row ``r``'s tokens of one verification, cut at max_new_tokens and at EOS,
        and count the round (``matched``: its drafts came from the text; ``cached``: from a
        suffix cache of earlier requests); True while the row goes on."""
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
        self.stats.rounds += 1
        self.stats.drafted += num_drafted
        self.stats.accepted += num_accepted
        self.stats.matched += matched
        if matched:
            self.stats.text_drafted += num_drafted
            self.stats.text_accepted += num_accepted
        if cached:
            self.stats.cache_matched += 1
            self.stats.cache_drafted += num_drafted
            self.stats.cache_accepted += num_accepted
            self.stats.row_cache_matched[r] += 1
        self.stats.accepted_lengths.append(num_accepted)
        self.stats.draft_lengths.append(num_drafted)
        self.stats.row_rounds[r] += 1
        self.stats.row_matched[r] += matched
        self.stats.row_drafted[r] += num_drafted
        self.stats.row_accepted[r] += num_accepted
        if self.streamer is not None:
            self.streamer.put(torch.tensor(emitted))
        return len(self.new[r]) < self.max_new and not (emitted and emitted[-1] in self.eos) and not stopped

    def finish(self) -> Stats:
        self.stats.new_tokens = sum(map(len, self.new))
        return self.stats
