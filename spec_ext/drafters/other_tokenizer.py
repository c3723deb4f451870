"""A draft model with another tokenizer than the target's (Timor et al., ICML 2025, arXiv 2502.05202).

Lossless modes (``docs/tokenizers.md``); either way the target verifies as usual, so the
output law is the target's at every temperature:

* ``"tli"`` (token-level intersection): drafts are target ids drawn from the draft's law on
  the tokens both vocabularies spell alike; that law, pushed onto the target's ids, is q.
* ``"slem"`` (string-level exact match): the draft drafts in its own vocabulary; the text of
  its drafts, re-tokenised by the target's tokenizer, is verified as deterministic drafts
  (with token healing at the context's last token).
* ``"auto"``: both, measured, then the one with more accepted drafts (SLEM alone where the
  draft's vocabulary covers under ``MIN_SHARE`` of the prompts' tokens).

Chains with every length policy, trees, and beside the text's drafts; parallel policies
(PEARL, SpecBranch) are refused with a ValueError.

The draft's forwards need its attention routed through spec_ext with its own vocabulary:
:func:`spec_ext.generate` opens that block around the rounds (a caller driving the drafter
itself: ``with spec_ext.models.attention_implementation(draft):``).

Example:
    >>> drafter = OtherTokenizerDrafter(draft, draft_tok, target_tok, mode="tli")       # doctest: +SKIP
    >>> spec_ext.generate(target, drafter, ids, max_new_tokens=64, policy=Fixed(4))   # doctest: +SKIP
"""
from __future__ import annotations

import bisect
import warnings

import torch
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, check_finite, draft_chain, feed_rows, \
    grow_tree, pad_rows, refeed_tree
from spec_ext.drafters.text import tree_proposal
from spec_ext.models import SpecCache, check_pair, forward, vocabulary_size
from spec_ext.policies import RoundPlan, continuation_tree
from spec_ext.vocab import PrefixIndex, VocabMap, prefix_index, vocab_map

MODES = ("tli", "slem", "auto")
MIN_SHARE = 0.2  # below this share of the target's tokens (by frequency) TLI warns, and auto runs SLEM only
PROBE = 3  # rounds auto runs each mode first, before it compares their accepted drafts per row and round
REPROBE = 32  # after that, one round in this many runs the mode that is behind (its measure kept current)
BACK = 2  # draft tokens re-tokenised at least, before the committed text's end


class OtherTokenizerDrafter(Drafter):
    """Drafts with ``model``, a causal LM whose tokenizer ``tokenizer`` is not the target's
    ``target_tokenizer``, chains or trees as the round's plan says, in ``mode`` (see the
    module docstring; ``hidden``: plans that stop per draft step read the draft's hidden
    state). Both tokenizers must be fast (tokenizers-library) tokenizers."""

    def __init__(self, model, tokenizer, target_tokenizer, mode: str = "auto", hidden: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        self.model, self.tokenizer, self.target_tokenizer, self.mode = model, tokenizer, target_tokenizer, mode
        self.vocab: VocabMap = vocab_map(tokenizer, target_tokenizer)
        self.prefixes: PrefixIndex = prefix_index(tokenizer, "draft_tokenizer")
        self.hidden = hidden
        self.rounds_by_mode = {"tli": 0, "slem": 0}  # this call's rounds in each mode
        # the special tokens the draft's tokenizer puts before a text (its BOS), fed once per row
        plain = tokenizer("a", add_special_tokens=False).input_ids
        full = tokenizer("a", add_special_tokens=True).input_ids
        self.lead = full[:full.index(plain[0])] if plain and plain[0] in full else []
        # a row whose context would be empty (no lead, no text yet) is fed this one token
        self.filler = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), 0)

    def bind(self, target) -> None:
        check_pair(target, self.model)
        self.target_size, self.draft_size = vocabulary_size(target), vocabulary_size(self.model)
        self.map = self.vocab.padded(self.draft_size, self.target_size)
        # the target's special tokens the draft has no token for (by content) are left out of
        # the text; the others are written as their content, which the draft's tokenizer reads
        # back as its own special token
        specials = {i for i, t in self.target_tokenizer.added_tokens_decoder.items() if t.special}
        self.unshared_specials = {i for i in specials if i >= len(self.map.target_to_draft) or
                                  self.map.target_to_draft[i] < 0}
        if self.mode == "tli" and self.map.shared == 0:
            raise ValueError("draft: its tokenizer shares no token with the target's; token-level intersection "
                             "cannot propose anything (use mode='slem')")

    # ------------------------------------------------------------------ state
    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        if not hasattr(self, "map"):
            raise ValueError("draft: bind(target) must come before start (spec_ext.generate calls both)")
        self.sampler, self.generator, self.calls = sampler, generator, 0
        self.device = self.model.device
        self.share = share = self.map.share_by_frequency([t for s in seqs for t in s])
        self.rounds_by_mode = {"tli": 0, "slem": 0}
        self.tally = {"tli": [0, 0], "slem": [0, 0]}  # (rows, accepted drafts) of the rounds in each mode
        self.current, self._own = None, None  # this round's mode, and its rows (None: all) beside the text's
        self.explores = False
        if self.mode == "tli" and share < MIN_SHARE:
            warnings.warn(f"draft: its vocabulary covers {share:.0%} of the prompts' target tokens (by frequency); "
                          f"token-level intersection will rarely be accepted (try mode='slem')", stacklevel=3)
        B = len(seqs)
        self.text = [""] * B  # the committed text of each row (see the module docstring)
        self.read = [0] * B  # target tokens the text holds
        self.dids: list[list[int]] = [[] for _ in range(B)]  # draft tokens in the cache, per row
        self.starts: list[list[int]] = [[] for _ in range(B)]  # where each aligned draft token starts in the text
        self.aligned = [0] * B  # dids[:aligned] tokenise text (past the lead); the rest are fed drafts
        self.moved = 0  # draft tokens of the committed text re-tokenised otherwise (a boundary that moved)
        shared = (self.map.draft_to_target >= 0).nonzero().squeeze(1)
        # [S] the shared draft ids, [S] their target ids, [Vt] the target -> draft map, on the device once
        self._tables = tuple(t.to(self.device) for t in (shared, self.map.draft_to_target[shared],
                                                          self.map.target_to_draft))
        # [Vd] each draft id's rank by bytes (token healing); ids past the tokenizer's never in a range
        rank = self.prefixes.rank
        self._rank = torch.cat([rank, rank.new_full((max(0, self.draft_size - len(rank)),), len(rank))]
                               )[:self.draft_size].to(self.device)
        self._decode(seqs)
        longest = max(map(len, self.tokenizer(self.text, add_special_tokens=False).input_ids))
        self.cache = SpecCache.for_model(self.model, B, len(self.lead) + longest + 2 * capacity + 16)

    def _decode(self, seqs: list[list[int]]) -> None:
        """Bring each row's text up to its committed target tokens (the last characters held
        back while they may be an incomplete UTF-8 sequence: for up to 3 more tokens)."""
        skip = self.unshared_specials

        def decode(ids: list[int]) -> str:
            return self.target_tokenizer.decode([t for t in ids if t not in skip], skip_special_tokens=False)

        for b, ids in enumerate(seqs):
            if len(ids) == self.read[b]:
                continue
            # decode a window of a few tokens before the new ones and keep what it adds
            # (decoders strip a first token's space or join words: both windows alike)
            back = max(0, self.read[b] - 4)
            old, new = decode(ids[back:self.read[b]]), decode(ids[back:])
            if not new.startswith(old):  # a decoder that is not incremental here: start the row over
                self.text[b], self.read[b], self.aligned[b] = decode(ids), len(ids), 0
                continue
            if new.endswith("\ufffd") and len(ids) - self.read[b] < 4:
                continue  # an incomplete character: wait for its other bytes (a UTF-8 character has 4 at most)
            self.text[b] += new[len(old):]
            self.read[b] = len(ids)

    def _window(self, b: int) -> tuple[int, int]:
        """(j, s): re-tokenise row b's text from character s on, replacing its draft tokens from
        j on: the last draft token at least ``BACK`` before the last aligned one that starts a
        word (at or right after whitespace: a token there tokenises as it does inside the
        text), found by the text's whitespace however far back (a long run without any, as
        code has, is not the whole text re-tokenised)."""
        lead, starts, text = len(self.lead), self.starts[b], self.text[b]
        i = self.aligned[b] - 1 - BACK - lead  # index into starts
        while i >= 0:
            s = starts[i]
            if s >= len(text):
                i -= 1
            elif s == 0 or text[s].isspace() or text[s - 1].isspace():
                # the first token that starts there (a character's bytes may be several tokens)
                return bisect.bisect_left(starts, s, 0, i) + lead, s
            else:  # the last token that starts at or right after the last whitespace before s
                space = s - 1
                while space >= 0 and not text[space].isspace():
                    space -= 1
                if space < 0:
                    break
                i = bisect.bisect_right(starts, space + 1, 0, i) - 1
        return lead, 0

    def _sync(self, heal: bool = False) -> tuple[Tensor, Tensor | None, list[bytes | None]]:
        """Re-tokenise each row's tail, roll the draft cache back to the first token that
        differs and feed the rest (at least the last token). Returns the draft's logits
        [B,Vd] after each row's context (and its hidden state [B,H], for policies that read
        it), and per row the bytes its context left out (None where nothing is left out):
        the first draft token must begin with them (its logits are masked to such tokens).

        ``heal``: token healing, in the same forward (:meth:`_heal`)."""
        B = len(self.text)
        aligned_before = list(self.aligned)
        lead = len(self.lead)
        windows = [self._window(b) for b in range(B)]
        # each window tokenised after the token before it (a dummy prefix falls on that one)
        heads = [self.text[b][self.starts[b][j - 1 - lead]:s] if j > lead else "" for b, (j, s) in enumerate(windows)]
        encoded = _encode_after(self.tokenizer, heads, [self.text[b][s:] for b, (_, s) in enumerate(windows)])
        for b in (b for b, tail in enumerate(encoded) if tail is None):  # a token across the two: the whole text
            windows[b] = lead, 0
            encoded[b] = _encode_after(self.tokenizer, [""], [self.text[b]])[0]
        keep, feed, healed = [], [], []
        for b, (j, s) in enumerate(windows):
            ids, offsets = encoded[b]
            dids, starts = self.dids[b], self.starts[b]  # edited in place from the window on
            if dids:  # the first token from j on that differs from what the cache holds
                c, n = j, min(len(dids), j + len(ids))
                while c < n and dids[c] == ids[c - j]:
                    c += 1
                self.moved += max(0, min(aligned_before[b], len(dids)) - c)
                del dids[j:]
            else:  # a row's first sync (j is past the lead)
                c = 0
                dids.extend(self.lead)
            dids.extend(ids)
            del starts[j - lead:]
            starts.extend(s + o for o in offsets)
            if not dids:  # no lead and no text yet: the filler, replaced once there is text
                dids.append(self.filler)
            self.aligned[b] = len(starts) + lead
            left_out = self._left_out(b, dids, starts) if heal else None
            # feed the last token again (its logits propose the first draft), and the one before
            # where healing may propose from there instead
            c = min(c, len(dids) - 1 - (left_out is not None))
            keep.append(c)
            feed.append(dids[c:])
            healed.append(left_out)
        self.cache.rollback(keep)
        out, last = feed_rows(self.cache, pad_rows(feed, 0, self.device), [len(f) for f in feed], self._forward)
        logits, hidden = out.logits, out.hidden
        if self.calls == 1:
            check_finite(logits, "draft")
        rows = torch.arange(B, device=self.device)
        after = logits[rows, last], None if hidden is None else hidden[rows, last]
        if all(left_out is None for left_out in healed):
            return *after, healed
        last = (last - 1).clamp_min(0)  # the position before (a healable row fed both)
        before = logits[rows, last], None if hidden is None else hidden[rows, last]
        return self._heal(after, before, healed)

    def _heal(self, after: tuple[Tensor, Tensor | None], before: tuple[Tensor, Tensor | None],
              healed: list[bytes | None]) -> tuple[Tensor, Tensor | None, list[bytes | None]]:
        """Token healing. A context cut where the text ends rarely ends a draft token, and a
        token that ends there (``▁self`` of ``self.``) makes the draft continue as if the
        word were over. Where row b's last token r has bytes ``healed[b]`` that end the text,
        the draft's greedy choice at r's place among the tokens that begin with those bytes
        decides: r itself or a token of r's bytes (the context keeps r; the logits ``after``
        it propose), or a longer token (r leaves the context and the cache; the logits
        ``before`` it, masked to those tokens, propose). ``after`` and ``before``: (logits
        [B,Vd], hidden [B,H] or None) at each row's last token and the one before it.
        Returns the proposing logits and hidden and per row the bytes the context left out."""
        masked = self._mask_to_prefixes(before[0], healed)
        token_bytes = self.prefixes.token_bytes
        # a token of other bytes than r's (not r, nor a byte-fallback spelling of its bytes)
        longer = [left_out is not None and token_bytes[choice] != left_out
                  for left_out, choice in zip(healed, masked.argmax(-1).tolist())]
        if not any(longer):
            return *after, [None] * len(healed)
        self.cache.rollback([n - out for n, out in zip(self.cache.host_lengths, longer)])
        for b in (b for b, out in enumerate(longer) if out):
            self.dids[b].pop()
            self.starts[b].pop()
            self.aligned[b] -= 1
        rows = torch.tensor(longer, device=self.device)
        logits = torch.where(rows[:, None], masked, after[0])
        hidden = None if after[1] is None else torch.where(rows[:, None], before[1], after[1])
        return logits, hidden, [left_out if out else None for left_out, out in zip(healed, longer)]

    def _left_out(self, b: int, new: list[int], starts: list[int]) -> bytes | None:
        """The bytes of row b's last draft token, when token healing can leave it out: it is a
        text token (not the lead), an ordinary one, some token comes before it, and its bytes
        end the text (a normalizer may have changed them), in a vocabulary whose bytes spell
        the text."""
        if len(new) < 2 or not starts or not self.prefixes.spelled:
            return None
        tail = self.prefixes.token_bytes[new[-1]] if new[-1] < len(self.prefixes.token_bytes) else None
        if not tail or not self.text[b][-len(tail):].encode().endswith(tail):
            return None
        return tail

    def _forward(self, ids: Tensor, positions: Tensor, mask: Tensor | None = None):
        """The draft's logits [B,T,Vd] over its own vocabulary (and hidden states [B,T,H])."""
        self.calls += 1
        return forward(self.model, ids, self.cache, positions, mask, self.hidden)

    # ------------------------------------------------------------------ rounds
    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan, forced: Tensor | None = None,
                forced_rows: Tensor | None = None) -> Proposal:
        """A chain per row of up to ``plan.budget()[b]`` target tokens, where the plan's
        ``keep_drafting`` says, or the plan's tree. ``forced_rows`` [B] bool: the rows whose
        drafts come from elsewhere (the text's: its drafts there are not re-tokenised, and those
        tokens are not fed: the next round re-tokenises whatever the target commits); its drafts
        there are left for :func:`~spec_ext.drafters.merge` to replace (``forced`` is not read)."""
        self._plan = plan
        self._begin(seqs)
        if plan.tree is not None:
            if self.current == "tli":
                proposal = self._tli_tree(plan, self._sync()[0], roots)
            else:
                logits, _, healed = self._sync(heal=True)
                proposal = self._slem_tree(plan, logits, healed)
            proposal.explores = self.explores
            return proposal
        if forced_rows is not None:
            self._own = (~forced_rows).tolist()
        # (the bonus agreement is not computed across tokenizers: it counts as broken)
        budget = plan.budget(torch.zeros(len(seqs), dtype=torch.bool, device=self.device)
                             if plan.reads_agreement else None)
        if self.current == "tli":
            drafts, q, num_draft = self._tli(*self._sync()[:2], budget)
        else:
            (drafts, num_draft), q = self._slem(*self._sync(heal=True), budget), None
        return Proposal(drafts, num_draft, q, explores=self.explores)

    def skip(self) -> None:
        """A round without this drafter: nothing to do (the next re-tokenises the text)."""
        self.current = None

    def _begin(self, seqs: list[list[int]]) -> None:
        """Bring the rows' texts up to ``seqs`` and choose the round's mode."""
        self._decode(seqs)
        (self.current, leader), self._own = self._choose(), None
        self.explores = self.current != leader  # a round of the mode behind: the policy does not learn from it
        self.rounds_by_mode[self.current] += 1

    @property
    def mode_used(self) -> str | None:
        """The mode of most of the last call's rounds (None before any)."""
        counts = self.rounds_by_mode
        return None if not any(counts.values()) else max(counts, key=lambda m: (counts[m], m == self.current))

    def _choose(self) -> tuple[str, str]:
        """(this round's mode, the mode it is measured to be worth running): ``mode``, or
        under ``"auto"`` SLEM alone where the draft covers less than ``MIN_SHARE`` of the
        prompts' target tokens; else ``PROBE`` rounds of each (SLEM first when greedy, TLI
        first when sampling: the mode that is likelier ahead, and the leader meanwhile), then
        the mode with more accepted drafts per row and round so far (one round in ``REPROBE``
        the other)."""
        if self.mode != "auto":
            return self.mode, self.mode
        if self.share < MIN_SHARE:
            return "slem", "slem"
        n = sum(self.rounds_by_mode.values())
        if n < 2 * PROBE:
            first, second = ("slem", "tli") if self.sampler.greedy else ("tli", "slem")
            return (first if n < PROBE else second), first
        mean = {m: accepted / max(1, rows) for m, (rows, accepted) in self.tally.items()}
        best, behind = ("tli", "slem") if mean["tli"] >= mean["slem"] else ("slem", "tli")
        return (behind if n % REPROBE == 0 else best), best

    def _to_target(self, draft_logits: Tensor) -> Tensor:
        """[...,Vd] -> [...,Vt]: the shared tokens' logits at their target ids, -inf elsewhere."""
        shared, targets, _ = self._tables
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.target_size), float("-inf"))
        out[..., targets] = draft_logits[..., shared]
        return out

    def _tli(self, logits: Tensor, hidden: Tensor | None, budget: list[int]):
        """Token-level intersection: drafts are target ids drawn from the draft's law on the
        shared tokens, with that law (pushed onto the target's vocabulary) as q [B,K,Vt]."""
        t2d = self._tables[2]
        return self._chain(logits, hidden, self.sampler, budget, to_draft=lambda token: t2d[token].clamp_min(0),
                           to_logits=self._to_target)

    def _tli_tree(self, plan: RoundPlan, logits: Tensor, roots: Tensor) -> Proposal:
        """The policy's tree of target ids grown from the draft's logits on the shared tokens
        (a static tree's top-k or EAGLE-2's scores), re-fed to the draft as its own ids."""
        t2d, context_last = self._tables[2], self._context_last()

        def refeed(tokens: Tensor, parents: Tensor, depth: Tensor, mask: Tensor) -> Tensor:
            ids = t2d[tokens.clamp_min(0)].clamp_min(0)
            ids[:, 0] = context_last
            return self._to_target(self._refeed(ids, parents, depth, mask))

        return grow_tree(plan.tree, self._to_target(logits), roots, refeed, self.sampler)

    def _slem(self, logits: Tensor, hidden: Tensor | None, healed: list[bytes | None], budget: list[int]):
        """String-level exact match: the draft's greedy chain (its first token beginning with
        the bytes its context left out, where ``healed`` has them), its text re-tokenised by
        the target's tokenizer: deterministic drafts [B,K] and num_draft [B]. A first token
        that heals adds a few bytes only: where every row's does, one step more (measured
        better at batch 1; where some rows' do not, their wait would cost more). Rows whose
        drafts are the text's (beside NGram) are not re-tokenised."""
        own = self._own or [True] * len(healed)
        extra = all(left_out is not None for left_out, mine in zip(healed, own) if mine)
        steps = [k + extra for k in budget]
        drafts, _, num_draft = self._chain(logits, hidden, Sampler(0.0), steps)
        rows = torch.cat([num_draft[:, None], drafts], 1).tolist()  # one copy to the host
        texts = [self._text_of(b, row[1:1 + row[0]], left_out) if mine else ""
                 for b, (row, left_out, mine) in enumerate(zip(rows, healed, own))]
        proposals = [ids[:k] for ids, k in zip(self._retokenise(texts), budget)]
        tokens = pad_rows([p or [-1] for p in proposals], -1, self.device)
        return tokens, torch.tensor([len(p) for p in proposals], device=self.device)

    def _slem_tree(self, plan: RoundPlan, logits: Tensor, healed: list[bytes | None]) -> Proposal:
        """The policy's tree grown in the draft's vocabulary (healed as the chain is); each
        root-to-leaf path's text re-tokenised by the target's tokenizer, the paths merged
        into one tree of target tokens with as many nodes as the draft's
        (:func:`~spec_ext.policies.continuation_tree`, the most shared nodes kept)."""
        tree = grow_tree(plan.tree, logits, self._context_last(), self._refeed)
        B, T = tree.tokens.shape
        tokens, parents = tree.tokens.tolist(), tree.parents.expand(B, T).tolist()
        rows, texts = [], []
        for b in range(B):
            inner = set(parents[b][1:])
            for leaf in range(1, T):
                if leaf in inner or tokens[b][leaf] < 0:
                    continue
                path, node = [], leaf
                while node > 0:
                    path.append(tokens[b][node])
                    node = parents[b][node]
                rows.append(b)
                texts.append(self._text_of(b, path[::-1], healed[b]))
        paths = [[] for _ in range(B)]
        for b, ids in zip(rows, self._retokenise(texts, rows)):
            paths[b].append(ids)
        trees = [continuation_tree(p, T) for p in paths]
        return tree_proposal(trees, self.device)

    def _mask_to_prefixes(self, logits: Tensor, healed: list[bytes | None]) -> Tensor:
        """``logits`` [B,Vd] with every token that does not begin with row b's bytes
        ``healed[b]`` at -inf (rows with None as they are)."""
        everything = (-1, len(self.prefixes.token_bytes) + 1)
        lo, hi = torch.tensor([everything if r is None else self.prefixes.bounds(r) for r in healed],
                              device=self.device).T
        allowed = (self._rank >= lo[:, None]) & (self._rank < hi[:, None])
        return logits.masked_fill(~allowed, float("-inf"))

    def _context_last(self) -> Tensor:
        """[B] the last draft token of each row's context (a tree's root, re-fed in place)."""
        return torch.tensor([ids[-1] for ids in self.dids], device=self.device)

    def _refeed(self, ids: Tensor, parents: Tensor, depth: Tensor, mask: Tensor) -> Tensor:
        """The draft's logits [B,n,Vd] at a tree's nodes of draft ids (:func:`refeed_tree`)."""
        return refeed_tree(self.cache, self._forward, ids, depth, mask).logits

    def _chain(self, logits: Tensor, hidden: Tensor | None, sampler: Sampler, budget: list[int], to_draft=None,
               to_logits=None):
        """:func:`draft_chain` over the draft's cache: ``to_draft`` maps a proposed token to
        the draft id fed, ``to_logits`` the draft's logits to those proposed from. Each row's
        fed tokens are appended to its draft tokens (unaligned: the next sync replaces them)."""
        B, fed = len(self.text), []
        self.cache.reserve(max(self.cache.host_lengths) + max(budget))

        def step(token: Tensor) -> tuple[Tensor, Tensor | None]:
            ids = token if to_draft is None else to_draft(token)
            fed.append(ids)
            out = self._forward(ids[:, None], self.cache.lengths[:, None])
            self.cache.advance([1] * B)
            out_logits, out_hidden = out.logits[:, 0], None if out.hidden is None else out.hidden[:, 0]
            return (out_logits if to_logits is None else to_logits(out_logits)), out_hidden

        first = logits if to_logits is None else to_logits(logits)
        drafts, q, num_draft, _ = draft_chain(self._plan, sampler, self.generator, first, hidden, step, budget)
        if fed:
            for b, row in enumerate(torch.stack(fed, 1).tolist()):
                self.dids[b] += row
        return drafts, q, num_draft

    def _text_of(self, b: int, tokens: list[int], left_out: bytes | None) -> str:
        """The text draft ``tokens`` add after row b's committed text: their bytes (less the
        ``left_out`` bytes the first one begins with) up to the first added or special token
        (an EOS ends the draft's text) and the last complete UTF-8 character; in a
        vocabulary whose bytes do not spell the text, what decoding them after the last few
        context tokens adds."""
        if not self.prefixes.spelled:
            context = self.dids[b][max(len(self.lead), self.aligned[b] - 4):self.aligned[b]]
            old = self.tokenizer.decode(context, skip_special_tokens=True)
            new = self.tokenizer.decode(context + tokens, skip_special_tokens=True)
            return new[len(old):].rstrip("\ufffd") if new.startswith(old) else ""
        token_bytes, pieces = self.prefixes.token_bytes, []
        for t in tokens:
            piece = token_bytes[t] if t < len(token_bytes) else None
            if piece is None:
                break
            pieces.append(piece)
        data = b"".join(pieces)
        if left_out is not None:
            if not data.startswith(left_out):
                return ""
            data = data[len(left_out):]
        try:
            return data.decode()
        except UnicodeDecodeError as error:  # a character cut by the chain's end: up to it
            return data[:error.start].decode()

    def _retokenise(self, texts: list[str], rows: list[int] | None = None) -> list[list[int]]:
        """The target tokens of each ``texts[i]`` written after row ``rows[i]``'s committed text
        (``rows`` None: text i is row i's), in one tokenizer call. A text is tokenised from the
        committed text's last word on, so it tokenises as it would in place; where a token
        would straddle the end of the committed text, the text alone."""
        rows = range(len(texts)) if rows is None else rows
        heads = []
        for b, text in zip(rows, texts):
            committed = self.text[b] if text else ""
            start = max((committed.rfind(c) for c in " \n\t"), default=-1)
            heads.append(committed[max(start, 0, len(committed) - 64):])
        encoded = _encode_after(self.target_tokenizer, heads, texts)
        out = [[] if tail is None else tail[0] for tail in encoded]
        alone = [i for i, tail in enumerate(encoded) if tail is None]
        if alone:
            for i, encoding in zip(alone, _encode(self.target_tokenizer, [texts[i] for i in alone])):
                out[i] = encoding.ids
        # up to a token past the target model's vocabulary (a tokenizer larger than its embedding)
        return [next((ids[:j] for j, t in enumerate(ids) if t >= self.target_size), ids) for ids in out]

    def commit(self, outcome: Outcome) -> None:
        """Counts the round's accepted drafts for its mode (``"auto"`` compares them); the
        next round re-tokenises the committed text's tail and rolls the draft cache back to
        the first draft token that differs."""
        if self.current is None:  # a round of the text's drafts alone
            return
        own = outcome.accepted if self._own is None else [a for a, mine in zip(outcome.accepted, self._own) if mine]
        tally = self.tally[self.current]
        tally[0] += len(own)
        tally[1] += sum(own)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.cache.keep_rows(rows)
        for name in ("text", "read", "dids", "starts", "aligned"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in rows])


def _encode_after(tokenizer, heads: list[str], tails: list[str]) -> list[tuple[list[int], list[int]] | None]:
    """Each ``tails[i]`` tokenised as it is after ``heads[i]``, in one tokenizer call (each
    pair encoded together and the head's tokens dropped: where a tokenizer writes a dummy
    prefix, Llama-2's ``▁``, it falls on the head): its ids and where each starts in the
    tail; None where a token straddles the two. An empty head: the tail's tokens, all."""
    out = []
    for head, encoding in zip(heads, _encode(tokenizer, [h + t for h, t in zip(heads, tails)])):
        n, offsets = len(head), encoding.offsets
        first = 0 if n == 0 else next((j for j, (s, e) in enumerate(offsets) if s >= n and e > s), len(offsets))
        if any(e > n for _, e in offsets[:first]):
            out.append(None)
        else:
            out.append((encoding.ids[first:], [s - n for s, _ in offsets[first:]]))
    return out


def _encode(tokenizer, texts: list[str]) -> list:
    """``tokenizer``'s encodings of ``texts`` without special tokens (``.ids``, ``.offsets``
    in characters), by its tokenizers-library backend at once: the rounds' hot path."""
    backend = tokenizer.backend_tokenizer
    return [backend.encode(text, add_special_tokens=False) for text in texts]
