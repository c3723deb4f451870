"""HF's logits processors, applied at every verified and drafted position with that position's
own prefix, in the order of transformers' ``_get_logits_processor``, batched over rows and
positions on the device.

A row's prefix, as HF's ``input_ids`` holds it: the prompt as given (left padding included;
ragged prompts given as lists are left-padded with the pad id to the longest), the tokens
committed since, then the position's path of drafts (:class:`Positions`). The repetition
penalty ignores the padding, as HF does with an attention mask; the n-gram, sequence-bias
and length rules read it, as HF does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter as _clock
from typing import Callable

import torch
from torch import Tensor

from spec_ext.processing.positions import Positions

NEG_INF = float("-inf")


@dataclass
class Settings:
    """The processor settings of one call (HF's names and meanings). ``eos`` the EOS ids the
    length rules ban; ``logits_processor`` HF-contract callables ``(input_ids [N,L], scores
    [N,V]) -> scores``; ``prefix_allowed_tokens_fn(batch_id, input_ids [L]) -> list[int]``;
    ``batch_ids`` each row's batch id for it (rows repeated by ``num_return_sequences``
    share one)."""
    sequence_bias: dict[tuple[int, ...], float] = field(default_factory=dict)
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] = field(default_factory=list)
    min_length: int = 0
    min_new_tokens: int = 0
    prefix_allowed_tokens_fn: Callable | None = None
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)
    logits_processor: list = field(default_factory=list)
    eos: list[int] = field(default_factory=list)
    batch_ids: list[int] = field(default_factory=list)

    @property
    def active(self) -> list[str]:
        """The names of the settings that change anything, in HF's order."""
        names = [name for name, on in (
            ("sequence_bias", self.sequence_bias), ("repetition_penalty", self.repetition_penalty != 1.0),
            ("no_repeat_ngram_size", self.no_repeat_ngram_size > 0), ("bad_words_ids", self.bad_words),
            ("min_length", self.min_length > 0 and self.eos), ("min_new_tokens", self.min_new_tokens > 0 and self.eos),
            ("prefix_allowed_tokens_fn", self.prefix_allowed_tokens_fn is not None),
            ("suppress_tokens", self.suppress_tokens), ("begin_suppress_tokens", self.begin_suppress_tokens))
            if on]
        return names + ["logits_processor"] * bool(self.logits_processor)

    @property
    def bad_words(self) -> dict[tuple[int, ...], float]:
        """bad_words_ids as -inf biases; a bad word that is exactly one EOS id is dropped, as in HF."""
        return {tuple(w): NEG_INF for w in self.bad_words_ids if not (len(w) == 1 and w[0] in self.eos)}


def _hf_classes() -> dict[str, type]:
    """The HF processor class of each built-in setting: a user processor of that class
    replaces the setting's in its place (HF's ``_merge_criteria_processor_list``)."""
    from transformers import generation as g
    return {"sequence_bias": g.SequenceBiasLogitsProcessor, "repetition_penalty": g.RepetitionPenaltyLogitsProcessor,
            "no_repeat_ngram_size": g.NoRepeatNGramLogitsProcessor, "bad_words_ids": g.NoBadWordsLogitsProcessor,
            "min_length": g.MinLengthLogitsProcessor, "min_new_tokens": g.MinNewTokensLengthLogitsProcessor,
            "prefix_allowed_tokens_fn": g.PrefixConstrainedLogitsProcessor,
            "suppress_tokens": g.SuppressTokensLogitsProcessor,
            "begin_suppress_tokens": g.SuppressTokensAtBeginLogitsProcessor}


class Processors:
    """The processors of one generate call and the state they read: each row's prefix as
    HF's ``input_ids`` holds it (host lists and a device buffer), the tokens each row has seen
    (the repetition penalty) and, with a grammar, each row's matcher. The engine calls
    :meth:`start`, then per round :meth:`apply` on the target's logits, :meth:`commit` with
    what it kept and :meth:`keep_rows`; drafters call :meth:`apply` on their own logits
    (the state is the committed text; the drafts so far are the positions' paths).

    Example:
        >>> processors = Processors(Settings(repetition_penalty=1.1), width=V)    # doctest: +SKIP
        >>> processors.start([[5, 6, 7]], [[5, 6, 7]], capacity=64, device="cpu")  # doctest: +SKIP
        >>> logits = processors.apply(logits, Positions.chain(drafts, num_draft))  # doctest: +SKIP
    """

    def __init__(self, settings: Settings, width: int, grammar=None):
        self.settings, self.width, self.grammar = settings, width, grammar
        self.steps = self._steps()
        s = settings
        self.in_place = s.prefix_allowed_tokens_fn is not None or bool(s.logits_processor)
        # whether a position can be left without a legal token (a bias alone is finite)
        self.can_ban = self.in_place or grammar is not None or any(
            (s.no_repeat_ngram_size, s.bad_words, s.min_length and s.eos, s.min_new_tokens and s.eos,
             s.suppress_tokens, s.begin_suppress_tokens, NEG_INF in s.sequence_bias.values()))
        self._masks: dict = {}
        self.seconds = 0.0  # time spent in apply and commit (the stats' processing time)

    def __bool__(self) -> bool:
        return bool(self.steps)

    @property
    def names(self) -> list[str]:
        """What this applies (for error messages)."""
        return self.settings.active + ["grammar"] * (self.grammar is not None)

    def _steps(self) -> list[Callable]:
        """HF's order; a user processor of a built-in's class takes its place, the others follow;
        the grammar (a processor the user would append) comes last."""
        s = self.settings
        builtin = {"sequence_bias": self._sequence_bias(s.sequence_bias),
                   "repetition_penalty": self._repetition_penalty, "no_repeat_ngram_size": self._no_repeat_ngram,
                   "bad_words_ids": self._sequence_bias(s.bad_words), "min_length": self._min_length,
                   "min_new_tokens": self._min_new_tokens, "prefix_allowed_tokens_fn": self._prefix_allowed,
                   "suppress_tokens": self._suppress, "begin_suppress_tokens": self._begin_suppress}
        classes, user = _hf_classes(), list(s.logits_processor)
        steps = []
        for name in s.active:
            if name == "logits_processor":
                continue
            custom = next((p for p in user if type(p) is classes[name]), None)
            steps.append(builtin[name] if custom is None else self._user(custom))
            if custom is not None:
                user.remove(custom)
        steps += [self._user(p) for p in user]
        if self.grammar is not None:
            steps.append(self._grammar)
        return steps

    # ------------------------------------------------------------------ state
    def start(self, rows: list[list[int]], real: list[list[int]], capacity: int, device) -> None:
        """``rows`` each row's prompt as HF's input_ids holds it (padding included), all of
        one width; ``real`` the same without padding; ``capacity`` the most tokens a row reaches."""
        self.rows = [list(r) for r in rows]
        self.prompt_width = len(rows[0])
        self.device = device
        self.history = torch.full((len(rows), capacity), -1, dtype=torch.int64, device=device)
        self.history[:, :self.prompt_width] = torch.tensor(rows, dtype=torch.int64, device=device)
        self.lengths = torch.full((len(rows),), self.prompt_width, dtype=torch.int64, device=device)
        # each row's distinct seen tokens (the prompt without padding, then what it commits) on the
        # host, and on the device [B,S] padded with the row's first one (a duplicate changes nothing)
        self.seen_sets = [{t for t in r if 0 <= t < self.width} or {0} for r in real]
        self.seen_lists = [sorted(x) for x in self.seen_sets]
        self.seen = self._seen_tensor()
        self.batch_ids = self.settings.batch_ids or list(range(len(rows)))
        if self.grammar is not None:
            self.grammar.start(len(rows))

    def commit(self, tokens: Tensor, counts: Tensor, committed: list[list[int]]) -> None:
        """Each row kept ``tokens[b, :counts[b]]`` ([B,W] and [B] on the device; ``committed``
        the same on the host)."""
        start = _clock()
        W = tokens.shape[1]
        columns = (self.lengths[:, None] + torch.arange(W, device=self.device)).clamp_max(self.history.shape[1] - 1)
        keep = torch.arange(W, device=self.device)[None, :] < counts[:, None]
        self.history.scatter_(1, columns, torch.where(keep, tokens, self.history.gather(1, columns)))
        self.lengths += counts
        grown = False
        for seen, order, new in zip(self.seen_sets, self.seen_lists, committed):
            for t in new:
                if t not in seen and 0 <= t < self.width:
                    seen.add(t)
                    order.append(t)
                    grown = True
        if grown and self.settings.repetition_penalty != 1.0:
            self.seen = self._seen_tensor()
        for row, new in zip(self.rows, committed):
            row += new
        if self.grammar is not None:
            self.grammar.commit(committed, set(self.settings.eos))
        self.seconds += _clock() - start

    def _seen_tensor(self) -> Tensor:
        longest = max(map(len, self.seen_lists))
        return torch.tensor([r + r[:1] * (longest - len(r)) for r in self.seen_lists], dtype=torch.int64,
                            device=self.device)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.rows = [self.rows[i] for i in rows]
        self.batch_ids = [self.batch_ids[i] for i in rows]
        self.history, self.lengths, self.seen = self.history[index], self.lengths[index], self.seen[index]
        self.seen_sets = [self.seen_sets[i] for i in rows]
        self.seen_lists = [self.seen_lists[i] for i in rows]
        if self.grammar is not None:
            self.grammar.keep_rows(rows)

    # ------------------------------------------------------------------ applying
    def apply(self, logits: Tensor, positions: Positions, check: bool = True) -> Tensor:
        """The processed scores [B,T,V] float32 of ``logits`` [B,T,V] at ``positions``. With
        ``check`` (verification), a position the verification can reach (every draft on its
        path allowed) left without a legal token raises ``ValueError`` naming the settings (one
        host sync); without (drafts), such a position becomes uniform: the verification of the
        same prefix then raises."""
        start = _clock()
        scores = logits.float()
        if self.in_place:  # user code and the prefix function write into the scores
            scores = scores.clone()
        ctx = _Context(self, positions)
        for step in self.steps:
            scores = step(scores, ctx)
        if self.can_ban:
            dead = torch.isneginf(scores.amax(-1))
            if not check:
                scores = scores.masked_fill(dead[..., None], 0.0)
            elif bool((problem := (dead | ctx.empty) & positions.reachable(scores) & ctx.callable).any()):
                b, t = problem.nonzero()[0].tolist()
                if bool(ctx.empty[b, t]):
                    raise ValueError(f"prefix_allowed_tokens_fn: returned an empty list for batch ID "
                                     f"{self.batch_ids[b]}: the constraint is unsatisfiable")
                raise ValueError(f"{', '.join(self.names)}: leave no legal next token after "
                                 f"{ctx.host_prefix(b, t)[-8:]} (row {self.batch_ids[b]}, the last tokens of its "
                                 f"prefix)")
        self.seconds += _clock() - start
        return scores

    def _token_mask(self, ids: list[int], V: int, device) -> Tensor:
        """[V] bool, True at ``ids`` (those below V), made once per device and width."""
        key = (tuple(ids), V, device)
        if key not in self._masks:
            mask = torch.zeros(V, dtype=torch.bool)
            mask[[t for t in ids if t < V]] = True
            self._masks[key] = mask.to(device)
        return self._masks[key]

    def _sequence_bias(self, biases: dict[tuple[int, ...], float]):
        if not biases:
            return None
        single = {k[0]: v for k, v in biases.items() if len(k) == 1}
        groups: dict[int, list] = {}
        for key, value in biases.items():
            if len(key) > 1:
                groups.setdefault(len(key) - 1, []).append((key, value))

        tables: dict = {}  # per (device, V): the single-token bias [V] and each group's prefixes, tokens, biases

        def prepare(V: int, device) -> tuple:
            """(A draft's logits may be narrower than the target's: what it cannot emit is left out.)"""
            bias = torch.zeros(V, device=device)
            ones = {t: v for t, v in single.items() if t < V}
            if ones:
                bias[list(ones)] = torch.tensor(list(ones.values()), device=device)
            multi = []
            for m, group in groups.items():
                group = [(k, v) for k, v in group if k[-1] < V]
                if group:
                    multi.append((torch.tensor([k[:-1] for k, _ in group], device=device),
                                  torch.tensor([k[-1] for k, _ in group], device=device),
                                  torch.tensor([v for _, v in group], device=device), m))
            return bias, multi

        def apply(scores: Tensor, ctx: _Context) -> Tensor:
            key = (scores.device, scores.shape[-1])
            if key not in tables:
                tables[key] = prepare(scores.shape[-1], scores.device)
            single_bias, multi = tables[key]
            bias = single_bias.expand_as(scores).clone()
            for prefixes, last, values, m in multi:  # prefixes [G, m]
                matched = (ctx.tail(m)[:, :, None, :] == prefixes).all(-1)  # [B,T,G]
                bias.index_add_(2, last, torch.where(matched, values, 0.0))
            return scores + bias
        return apply

    def _repetition_penalty(self, scores: Tensor, ctx: _Context) -> Tensor:
        """HF's gather/scatter over the tokens seen: the row's (kept as they commit) and the path's."""
        B, T, V = scores.shape
        path = ctx.positions.path
        path = torch.where(path >= 0, path, self.seen[:, None, :1])  # no path token there: a duplicate
        ids = torch.cat([self.seen[:, None, :].expand(B, T, -1), path], -1)
        narrow = V < self.width  # logits narrower than the widest model's: ids past them go to a dummy column
        if narrow:
            scores, ids = torch.nn.functional.pad(scores, (0, 1)), ids.clamp_max(V)
        picked = scores.gather(-1, ids)
        penalty = self.settings.repetition_penalty
        scores = scores.scatter(-1, ids, torch.where(picked < 0, picked * penalty, picked / penalty))
        return scores[..., :V] if narrow else scores

    def _no_repeat_ngram(self, scores: Tensor, ctx: _Context) -> Tensor:
        """Ban each token that would complete an n-gram already in the prefix: the windows that
        end in the committed tokens, then those that end in the position's path."""
        n, (B, T, V) = self.settings.no_repeat_ngram_size, scores.shape
        suffix = ctx.tail(n - 1)  # [B,T,n-1]
        banned = torch.zeros(B, T, V + 1, dtype=torch.bool, device=scores.device)
        longest = max(map(len, self.rows))  # the host copy: no sync
        if longest >= n:
            windows = self.history[:, :longest].unfold(1, n, 1)  # [B, H, n]
            ends = torch.arange(n, longest + 1, device=scores.device)
            inside = ends[None, :] <= self.lengths[:, None]  # [B, H]
            matched = (windows[:, None, :, :n - 1] == suffix[:, :, None, :]).all(-1) & inside[:, None, :]
            banned.scatter_(2, torch.where(matched, windows[:, None, :, -1].clamp_max(V), V), True)
        D = ctx.positions.path.shape[-1]
        if D:
            windows = ctx.tail(n - 1 + D).unfold(-1, n, 1)  # [B,T,D,n]: window k ends at path column k
            in_path = torch.arange(D, device=scores.device) >= D - ctx.positions.depth[..., None]
            matched = (windows[..., :n - 1] == suffix[:, :, None, :]).all(-1) & in_path & (windows >= 0).all(-1)
            banned.scatter_(2, torch.where(matched, windows[..., -1].clamp_max(V), V), True)
        banned &= (ctx.length >= n)[..., None]
        return scores.masked_fill(banned[..., :V], NEG_INF)

    def _ban(self, scores: Tensor, ids: list[int], where: Tensor | None = None) -> Tensor:
        banned = self._token_mask(ids, scores.shape[-1], scores.device)
        return scores.masked_fill(banned if where is None else banned & where[..., None], NEG_INF)

    def _min_length(self, scores: Tensor, ctx: _Context) -> Tensor:
        return self._ban(scores, self.settings.eos, ctx.length < self.settings.min_length)

    def _min_new_tokens(self, scores: Tensor, ctx: _Context) -> Tensor:
        return self._ban(scores, self.settings.eos, ctx.length - self.prompt_width < self.settings.min_new_tokens)

    def _suppress(self, scores: Tensor, ctx: _Context) -> Tensor:
        return self._ban(scores, self.settings.suppress_tokens)

    def _begin_suppress(self, scores: Tensor, ctx: _Context) -> Tensor:
        return self._ban(scores, self.settings.begin_suppress_tokens, ctx.length == self.prompt_width)

    def _prefix_allowed(self, scores: Tensor, ctx: _Context) -> Tensor:
        """HF's PrefixConstrainedLogitsProcessor, one call of the function per position that
        may reach user code. An empty list bans everything there; it raises (as in HF) only
        where the verification can reach (see :meth:`apply`)."""
        b_idx, t_idx = ctx.valid_index
        if not b_idx:
            return scores
        mask = torch.full((len(b_idx), scores.shape[-1]), NEG_INF)
        empty = []
        for i, (b, t) in enumerate(zip(b_idx, t_idx)):
            allowed = self.settings.prefix_allowed_tokens_fn(
                self.batch_ids[b], torch.tensor(ctx.host_prefix(b, t), device=scores.device))
            if len(allowed) == 0:
                empty.append(i)
            mask[i, allowed] = 0
        mask = mask.to(scores.device)
        picked = scores[b_idx, t_idx] + mask
        picked = torch.where(torch.isneginf(picked.amax(-1, keepdim=True)), mask, picked)
        scores[b_idx, t_idx] = picked
        if empty:
            ctx.empty[[b_idx[i] for i in empty], [t_idx[i] for i in empty]] = True
        return scores

    def _user(self, processor):
        """A processor with HF's contract, called once per prefix length over every valid
        position whose prefix has that length (its rows in batch order)."""
        def apply(scores: Tensor, ctx: _Context) -> Tensor:
            by_length: dict[int, list[tuple[int, int]]] = {}
            for b, t in zip(*ctx.valid_index):
                by_length.setdefault(len(ctx.host_prefix(b, t)), []).append((b, t))
            for group in by_length.values():
                b_idx, t_idx = [g[0] for g in group], [g[1] for g in group]
                ids = torch.tensor([ctx.host_prefix(b, t) for b, t in group], device=scores.device)
                scores[b_idx, t_idx] = processor(ids, scores[b_idx, t_idx]).to(scores.dtype)
            return scores
        return apply

    def _grammar(self, scores: Tensor, ctx: _Context) -> Tensor:
        bits = self.grammar.bitmask(ctx.host_paths()).to(scores.device, non_blocking=True)  # [B,T,W] int32
        shifts = torch.arange(32, dtype=torch.int32, device=scores.device)
        allowed = ((bits[..., None] >> shifts) & 1).bool().flatten(-2)
        V = scores.shape[-1]
        if V > allowed.shape[-1]:  # logits columns past the tokenizer's: never legal
            allowed = torch.cat([allowed, allowed.new_zeros(*allowed.shape[:-1], V - allowed.shape[-1])], -1)
        return scores.masked_fill(~allowed[..., :V], NEG_INF)


class _Context:
    """What the steps read of one :meth:`Processors.apply` call, each computed once on demand."""

    def __init__(self, processors: Processors, positions: Positions):
        self.p, self.positions = processors, positions
        self.length = processors.lengths[:, None] + positions.depth  # [B,T]: HF's input_ids.shape[-1]
        self._callable: Tensor | None = None
        self._empty: Tensor | None = None
        self._paths: list[list[list[int] | None]] | None = None
        self._valid: tuple[list[int], list[int]] | None = None

    @property
    def callable(self) -> Tensor:
        """[B,T] bool: the positions user code and the grammar see: valid ones with no EOS among their drafts."""
        if self._callable is None:
            p, path = self.p, self.positions.path
            eos = p._token_mask(p.settings.eos, p.width + 1, path.device)
            past_eos = (eos[path.clamp(0, p.width)] & (path >= 0)).any(-1)
            self._callable = self.positions.valid & ~past_eos
        return self._callable

    @property
    def empty(self) -> Tensor:
        """[B,T] bool: positions where prefix_allowed_tokens_fn allowed nothing."""
        if self._empty is None:
            self._empty = torch.zeros_like(self.positions.valid)
        return self._empty

    def tail(self, m: int) -> Tensor:
        """[B,T,m] the last m tokens of each position's prefix, right-aligned, -1 before its start."""
        path, depth = self.positions.path, self.positions.depth
        B, T, D = path.shape
        back = torch.arange(m - 1, -1, -1, device=path.device)  # column c holds the token back[c] from the end
        from_path = back < depth[..., None]
        path_token = path.gather(2, (D - 1 - back).clamp_min(0).expand(B, T, m)) if D else path.new_full((B, T, m), -1)
        column = self.p.lengths[:, None, None] - 1 - (back - depth[..., None])
        history = self.p.history.gather(1, column.clamp_min(0).view(B, -1)).view(B, T, m)
        return torch.where(from_path, path_token, torch.where(column >= 0, history, -1))

    @property
    def valid_index(self) -> tuple[list[int], list[int]]:
        if self._valid is None:
            b, t = self.callable.nonzero(as_tuple=True)
            self._valid = b.tolist(), t.tolist()
        return self._valid

    def host_paths(self) -> list[list[list[int] | None]]:
        """Each position's path on the host (None for positions user code does not see)."""
        if self._paths is None:
            path, depth = self.positions.path.tolist(), self.positions.depth.tolist()
            valid = self.callable.tolist()
            self._paths = [[p[len(p) - d:] if ok else None for p, d, ok in zip(pr, dr, vr)]
                           for pr, dr, vr in zip(path, depth, valid)]
        return self._paths

    def host_prefix(self, b: int, t: int) -> list[int]:
        return self.p.rows[b] + self.host_paths()[b][t]

