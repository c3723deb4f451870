"""Chain rules: how many drafts each row proposes per round (see :class:`Policy` for the
protocol the serial engine calls)."""
from __future__ import annotations

import time
import weakref
from collections import Counter

from torch import Tensor

from spec_ext.models.cache import split_size
from spec_ext.policies.base import Policy, register
from spec_ext.policies.ngram import NGram
from spec_ext.policies.step_costs import SAMPLED_ROWS, SAMPLED_WIDEST, verification_costs


@register
class Fixed(Policy):
    """Vanilla speculative decoding: always ``k`` drafts."""

    def __init__(self, k: int = 5):
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        self.max_draft = k


@register
class Heuristic(Policy):
    """HF assisted generation's "heuristic" schedule, per row: start at ``initial``
    drafts, +2 after a round where all were accepted, else -1 (at least 1)."""

    def __init__(self, initial: int = 20, max_draft: int = 64):
        self.initial = initial
        self.max_draft = max_draft

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self._k = [self.initial] * batch_size

    def plan(self) -> list[int]:
        return list(self._k)

    def observe(self, num_draft, num_accepted) -> None:
        self._k = [min(self.max_draft, k + 2) if a >= n else max(1, k - 1)
                   for k, n, a in zip(self._k, num_draft, num_accepted)]

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._k = [self._k[r] for r in rows]


@register
class Confidence(Policy):
    """HF assisted generation's default: up to ``max_draft`` drafts, stop once the draft's
    probability of the token it just proposed is below ``threshold``."""

    def __init__(self, threshold: float = 0.4, max_draft: int = 20):
        self.threshold = threshold
        self.max_draft = max_draft

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        return probs.gather(1, tokens[:, None]).squeeze(1) >= self.threshold


@register
class SVIP(Policy):
    """SVIP: stop once sqrt(c * H(q)) > h for the draft distribution q the last token came
    from (that token is kept as the last draft)."""

    def __init__(self, c: float = 0.15, h: float = 0.3, max_draft: int = 16):
        self.c = c
        self.h = h
        self.max_draft = max_draft

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return (self.c * entropy).sqrt() <= self.h


@register
class Auto(Policy):
    """The default: before every round, per row, what drafts and how far, to maximise
    expected tokens per second from what it measures as it goes.

    What drafts: with a draft model or a feature head, each row's own text too (the n-gram
    matcher of :class:`spec_ext.policies.NGram`, chains: ``text=True``; the drafter is then
    :class:`spec_ext.drafters.TextFirst`, which calls :meth:`choose`). Each round, a row
    whose text has a match drafts the text (cut to the best length) where the text is
    expected to give more accepted tokens than the model's k drafts, else the model does;
    the model runs at all only where some row takes it (a text-only round costs no draft
    step). Without the text (a bare drafter, ``text=False``) it chooses k alone (:meth:`plan`).

    Acceptance: runs are counted per depth, apart for the model and for the text (the chance
    that draft j is accepted once drafts 1..j-1 were, from the rounds that reached j, with
    ``prior_weight`` observations of a prior: ``prior_acceptance`` at j = 1, the pooled rate of
    the drafts past the first beyond it), so bursty acceptance (long runs on easy text, none
    on hard) is valued as it is, not as a geometric law with the same mean: j drafts yield
    1 + sum_{i<=j} S(i) tokens, S(i) the chance that the first i are all accepted. The text's
    runs also come from the rows that drafted the model: what their text offered against what
    the target committed (:meth:`observe_text`).

    Cost (greedy): a round verifying w tokens per row and running f draft forwards costs
    V(w) + f * D seconds. D is timed around the drafter's forwards (reported by the drafter
    through :meth:`drafted`); V(w) is the rest of the round, clocked from one round's start
    to the next, kept per width (a verification's cost by width is irregular: where the step
    reads weights, 5 tokens cost 1.4x one and 7 tokens 2.1x), each sample capped at 3x the
    estimate (a stall of the machine is not a cost of w); widths not yet seen are
    extrapolated from a least-squares line through those seen (those a chain verifies: a
    wider tree's round, reported through :meth:`verifies`, is kept apart). Both forget at
    ``forget_cost`` per round, so the choice follows rows finishing (a cheaper
    verification). The first round drafts the text and the model to ``initial``, the second
    the model alone at the narrowest width, so that two widths give the cost's slope (a third,
    at ``initial`` + 1, where the first round verified a tree wider than any chain); then
    every ``explore_every``-th round tries the model's k one more, the next such round one
    less, to keep its neighbours measured. A round weighs every cut of the text chains, none
    included: at batch > 1 one row's long chain widens every row's verification.

    Across calls: a policy kept from call to call (``accelerate`` keeps one) starts each greedy
    call from what the last greedy call measured: the verification's cost by width and a draft
    forward's (those of the last greedy call of the same batch size, as they stood when its
    first row finished; forgetting as above) and the model's acceptance runs. The text's runs
    start afresh (a prompt repeats itself or it does not), and so does a sampled call (whose
    lengths follow its own accepted counts, so that a seed reproduces its output whatever ran
    before). So a kept policy's greedy calls skip the first rounds' measuring (the initial k,
    the narrowest chain). Bound to another target or draft, it forgets them.

    Nothing drafts: with the text beside a drafter (:meth:`choose`), a plain decode step
    (width 1, no draft forward: a feature head waits too, MTP layers still catch up) is weighed as one more choice
    after the first ``PLAIN_AFTER`` rounds, and taken where it beats every draft (a tiny target
    whose step is call overhead, a batch on a step of weight reads where each verified token
    is arithmetic); every ``explore_every``-th round drafts anyway, so that acceptance stays
    measured and drafting resumes where the text turns easy.

    Greedy, lengths depend on timing and outputs do not. Sampling, which tokens come out
    depends on how the random stream is split into rounds, so there nothing is timed: V(w)
    is one target step whatever w and D the draft's share of the parameters (decoding reads
    every weight once per step); a seed (or ``torch.manual_seed``) then reproduces the output.
    Beside a block drafter, whose block is one forward however long, a flat V drafts the
    whole block (on a CPU, slower than the target alone at T=1): there V(w) is the target's
    verification of w tokens over one of 1, timed once per process by width
    (:func:`~spec_ext.policies.step_costs.verification_costs`, before the first such call's
    first round), so a seed reproduces the output within a process.

    Args:
        max_draft: the model's largest k and the text's longest chain.
        initial: the model's k until a round's cost is known.
        prior_acceptance, prior_weight: the chance of a first draft before any round, and how
            many observations each depth's prior is worth.
        forget_runs, forget_cost: the weight old acceptance runs and old round costs keep per round.
        explore_every: how often a round drafts off the best choice (k + 1, k - 1, or drafts
            where a plain step is best).
        text: also draft each row's own text (n-gram matches), where a drafter supports it.
        clock: seconds since some origin (time.perf_counter; tests pass a fake one).
    """

    PLAIN_AFTER = 16  # rounds before a plain step is weighed: until then acceptance is mostly the prior

    def __init__(self, max_draft: int = 12, initial: int = 4, prior_acceptance: float = 0.5, prior_weight: float = 1.0,
                 forget_runs: float = 0.99, forget_cost: float = 0.9, text: bool = True, explore_every: int = 8,
                 clock=time.perf_counter):
        if max_draft < 1 or not 1 <= initial <= max_draft:
            raise ValueError(f"max_draft, initial: need 1 <= initial <= max_draft, got {initial}, {max_draft}")
        if not 0 < prior_acceptance < 1 or not (0 < forget_runs <= 1 and 0 < forget_cost <= 1):
            raise ValueError(f"prior_acceptance, forget_runs, forget_cost: need 0 < prior_acceptance < 1 and "
                             f"forget rates in (0, 1], got {prior_acceptance}, {forget_runs}, {forget_cost}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight: must be > 0, got {prior_weight}")
        if explore_every < 2:
            raise ValueError(f"explore_every: must be >= 2, got {explore_every}")
        self.max_draft = max_draft
        self.initial = initial
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.forget_runs = forget_runs
        self.forget_cost = forget_cost
        self.explore_every = explore_every
        self.text = bool(text)
        self._clock = clock
        self._kept_costs: dict = {}  # batch size -> the last greedy call's (widths, draft costs) at that size
        self._kept_runs = None  # the model's runs at the end of the last greedy call
        self._batch = None  # the greedy call under way: its batch size (None: none, or a sampled one)
        self._full_batch_costs = None  # the call's costs when its first row finished (None: none has)

    @property
    def text_beside_draft(self) -> NGram | None:
        """The matcher's settings for the text drafts (:func:`spec_ext.drafters.build` puts a
        :class:`~spec_ext.drafters.TextDrafter` of them beside the model); None: the model alone."""
        if not self.text:
            return None
        if getattr(self, "_text_policy", None) is None:  # chains up to max_draft at every batch size
            self._text_policy = NGram(k=self.max_draft, tree=False, draft_k=self.max_draft, round_tokens=1 << 20)
        return self._text_policy

    def bind(self, target, draft) -> None:
        size = sum(p.numel() for p in target.parameters())
        self._size_ratio = sum(p.numel() for p in draft.parameters()) / size if size and draft is not None else None
        self._per_forward = 1
        pair = (weakref.ref(target), None if draft is None else weakref.ref(draft))
        if getattr(self, "_pair", None) != pair:  # another target or draft: nothing measured carries over
            self._kept_costs, self._kept_runs, self._batch = {}, None, None
        self._pair = pair
        self._target = pair[0]

    def see_draft_shape(self, drafts_per_forward: int) -> None:
        self._per_forward = drafts_per_forward

    @property
    def _largest_k(self) -> int:
        """The model's largest k: ``max_draft``, or a block drafter's block if smaller."""
        per_forward = getattr(self, "_per_forward", 1)
        return min(self.max_draft, per_forward) if per_forward > 1 else self.max_draft

    def _longest_priced(self) -> int:
        """The model's largest k this round: one past the deepest draft its rounds have reached,
        so a chain grows a draft a round where the estimates say it pays, never onto depths
        priced by the prior alone (a chain's width is timed once it has drafted that deep, so
        its cost is measured too). Beside a block drafter on held-out code (whose later slots
        fall off), a call's third round drafted 10 on the prior (1.5-2x the round of 3), then 7,
        then 5."""
        reached = self._runs["model"][0]
        deepest = max((j for j in range(1, self.max_draft + 1) if reached[j] >= 0.5), default=0)
        return max(1, min(self._largest_k, deepest + 1))

    def draft_forwards(self, k: int) -> int:
        """The draft forwards k drafts cost: k, or one per block of a block drafter."""
        return -(-k // getattr(self, "_per_forward", 1))

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        if self.text:
            self.text_beside_draft.start(batch_size, greedy)
        self._timed = greedy or getattr(self, "_size_ratio", None) is None
        target = getattr(self, "_target", lambda: None)()
        # sampling beside a block drafter (whose block is one forward however long: only the
        # verification's price bounds it); not a tensor-parallel target (its followers replay
        # its forwards: nothing else may run one)
        priced = not self._timed and target is not None and getattr(self, "_per_forward", 1) > 1 \
            and split_size(target) == 1
        self._sampled = verification_costs(target, batch_size, min(self._largest_k + 1, SAMPLED_WIDEST)) \
            if priced else None
        self._sampled_rows = min(batch_size, SAMPLED_ROWS)  # the rows it timed
        self._rounds, self._last, self._choice, self._narrowed = 0, None, None, 0
        self._k = self.initial
        if self._batch is not None:  # the last greedy call's estimates, for the next greedy call
            self._kept_costs[self._batch] = self._full_batch_costs or (self._widths, self._draft)
            self._kept_runs = self._runs["model"]
        self._batch, self._full_batch_costs = (batch_size if greedy else None), None
        fresh = [0.0] * (self.max_draft + 1), [0.0] * (self.max_draft + 1)
        # [j]: rounds that drafted j with 1..j-1 accepted; and j too. A greedy call's model runs carry over from
        # the last greedy call; the text's (each prompt's own) and a sampled call's start afresh (a seed then
        # reproduces a sampled call's output whatever ran before it)
        self._runs = {"model": self._kept_runs if greedy and self._kept_runs is not None else fresh,
                      "text": ([0.0] * (self.max_draft + 1), [0.0] * (self.max_draft + 1))}
        # w -> [weight, weighted seconds]; and the draft forwards' [weighted seconds, weighted forwards]:
        # the last greedy call's of this batch size
        self._widths, self._draft = self._kept_costs.get(batch_size, ({}, [0.0, 0.0])) if greedy else ({}, [0.0, 0.0])
        self._fit = None  # verify_cost's table of the widths seen and its line (None: to be made)
        self._round_draft = 0.0  # seconds of draft forwards in the round under way
        self._width = None  # the round under way: its verification width
        self._from_text = [False] * batch_size  # the round under way: the rows that draft their text

    # ------------------------------------------------------------------ estimates
    def survival(self, kind: str = "model") -> list[float]:
        """[S(1), ..., S(max_draft)]: the estimated chance that drafts 1..j are all accepted,
        of the model's drafts or (``kind="text"``) of the text's. Draft j's chance once 1..j-1
        were accepted is its rounds' rate with ``prior_weight`` observations of a prior: for
        j = 1 ``prior_acceptance``, past it the rate of every draft past the first (pooled over
        the depths, with the first draft's rate as its prior). A depth rarely reached, as past a
        short k, is so priced like the drafts after an accepted one: at a flat 0.5 a draft model
        on held-out code sat at k = 1, its deeper drafts never measured, where Fixed(5) has 2.6
        drafts a round accepted; priced by the depth before it, two failures at depth 3 early in
        a call priced the head's third draft and every one past it at 0.3 and kept it at
        k = 2-3 where k = 6 is best."""
        reached, passed = self._runs[kind]
        w = self.prior_weight
        first = (passed[1] + w * self.prior_acceptance) / (reached[1] + w)
        later = (sum(passed[2:]) + w * first) / (sum(reached[2:]) + w)
        chances, alive = [], first
        for j in range(1, self.max_draft + 1):
            if j > 1:
                alive *= (passed[j] + w * later) / (reached[j] + w)
            chances.append(alive)
        return chances

    @property
    def chain_expected(self) -> float:
        """The model's expected accepted drafts at its last chosen k (at ``initial`` where the
        last round's model drafted none)."""
        return self._cumulative("model")[min(self._k or self.initial, self.max_draft)]

    @property
    def text_rows(self) -> list[bool]:
        """The round under way: per row, whether it drafts its text (:meth:`choose`)."""
        return list(self._from_text)

    def draft_cost(self) -> float | None:
        """D: seconds of one draft forward (sampling: the draft's share of the parameters, in
        target steps); None until a drafter reported one (then V holds the drafts' cost too)."""
        if not self._timed:
            return max(self._size_ratio, 0.02)
        seconds, forwards = self._draft
        return seconds / forwards if forwards > 0 else None

    def verify_cost(self, width: int) -> float | None:
        """V(width): seconds of a round verifying ``width`` tokens per row, drafts aside
        (sampling: 1, one target step; beside a block drafter the verification of ``width``
        over one of 1 as timed once per process,
        :func:`~spec_ext.policies.step_costs.verification_costs`); None before any round was
        timed."""
        if not self._timed:
            costs, rows = self._sampled, self._sampled_rows
            return 1.0 if costs is None else costs.verify(rows, width) / costs.verify(rows, 1)
        if self._fit is None:  # once per round: the widths change only when a round is timed
            self._fit = self._fitted()
        seen, line = self._fit
        if width in seen:
            return seen[width]
        if not seen:
            return None
        if line is None:  # one width seen: a verification grows a little with its width
            (w0, v0), = seen.items()
            return v0 * max(0.5, 1 + 0.05 * (width - w0))
        mean_w, mean_v, slope = line
        return max(mean_v + slope * (width - mean_w), 0.5 * min(seen.values()))

    def _chain_widths(self) -> dict[int, list[float]]:
        """The timed widths a chain of this policy can verify (at most ``max_draft + 1``; all
        of them where none is): a wider one (a tree of :class:`~spec_ext.policies.Suffix`
        verified through :meth:`verifies`, on the tree path) would set the line the chain's
        widths are read from: a 32-token tree first, then 2 tokens, and 3-8 tokens are priced on
        the tree's slope, not the chains'."""
        chain = {w: entry for w, entry in self._widths.items() if w <= self.max_draft + 1}
        return chain or self._widths

    def _fitted(self) -> tuple[dict[int, float], tuple[float, float, float] | None]:
        """(width -> its mean seconds, the least-squares line through them as (mean width,
        mean seconds, slope), None below two widths; the widths a chain verifies)."""
        widths = self._chain_widths()
        seen = {w: s / n for w, (n, s) in widths.items() if n > 1e-6}
        if len(seen) < 2:
            return seen, None
        n = sum(widths[w][0] for w in seen)
        mean_w = sum(widths[w][0] * w for w in seen) / n
        mean_v = sum(widths[w][0] * v for w, v in seen.items()) / n
        var = sum(widths[w][0] * (w - mean_w) ** 2 for w in seen)
        slope = sum(widths[w][0] * (w - mean_w) * (v - mean_v) for w, v in seen.items()) / var
        return seen, (mean_w, mean_v, max(slope, 0.0))  # a wider verification never costs less

    @property
    def timed(self) -> bool:
        """Whether rounds are clocked (greedy, or no size ratio to price the drafts by)."""
        return self._timed

    def timed_widths(self) -> dict[int, tuple[float, float]]:
        """The timed rounds by verification width: width -> (decayed count, decayed seconds)."""
        return {w: (n, s) for w, (n, s) in self._widths.items()}

    # ------------------------------------------------------------------ the round's clock
    def drafted(self, seconds: float, forwards: int, averaged: bool = True) -> None:
        """The drafter's report: this round's draft forwards took ``seconds``. ``averaged``
        False: taken out of the round's time only, not into a forward's cost (a catch-up over a
        whole prompt)."""
        if self._timed and forwards > 0:
            self._round_draft += seconds
            if averaged:
                self._draft = [self.forget_cost * self._draft[0] + seconds,
                               self.forget_cost * self._draft[1] + forwards]

    def verifies(self, width: int) -> None:
        """The round under way verifies ``width`` tokens per row (the root included): its time
        is kept at that width (a drafter that verified more than this policy's chain)."""
        self._width = width

    def _tick(self) -> None:
        """A round begins: the one that just ended is timed, its drafts' seconds aside."""
        now = self._clock() if self._timed else None
        if self._last is not None and self._width is not None:
            seconds = now - self._last - self._round_draft
            n, total = self._widths.get(self._width, (0.0, 0.0))
            estimate = total / n if n > 1e-6 else self.verify_cost(self._width)  # (a tree's width: its own mean)
            if estimate is not None:
                seconds = min(seconds, 3 * estimate)
            for entry in self._widths.values():
                entry[0] *= self.forget_cost
                entry[1] *= self.forget_cost
            entry = self._widths.setdefault(self._width, [0.0, 0.0])
            entry[0] += 1.0
            entry[1] += max(seconds, 0.0)
            self._fit = None
        self._last, self._round_draft, self._choice = now, 0.0, None
        self._rounds += 1

    def _explored(self, k: int) -> int:
        """``k``, or one more / one less in the exploring rounds; in the second round, if one
        width alone is timed, the narrowest chain (or ``initial`` if that was it): two widths
        give the cost's slope, where a guess of it (+5% a token) kept a batch of 8 on a step of
        weight reads verifying 5 tokens a row at 4x the cost of 2."""
        if self._rounds == 2 and len(self._chain_widths()) == 1:
            return self._narrowest()
        phase = self._rounds % (2 * self.explore_every)
        step = 1 if phase == self.explore_every else -1 if phase == 0 else 0
        return min(self._largest_k, max(1, k + step))

    def _narrowest(self) -> int:
        """The k that times a second width: the narrowest chain, or ``initial`` if that was the
        width timed."""
        seen, = self._chain_widths()
        return 1 if seen > 2 else min(self._largest_k, max(2, self.initial))

    # ------------------------------------------------------------------ choices
    def _cumulative(self, kind: str) -> list[float]:
        tokens = [0.0]
        for chance in self.survival(kind):
            tokens.append(tokens[-1] + chance)
        return tokens  # [j]: expected accepted of j drafts

    def plan(self) -> list[int]:
        """The model's k for every row (the drafter drafts from the model alone, or
        :meth:`choose` already decided this round)."""
        if self._choice is not None:
            k, self._choice = self._choice, None
            return [k] * self.batch_size
        self._tick()
        model = self._cumulative("model")
        D = self.draft_cost() or 0.0  # unreported: V(k + 1) holds the drafts' cost
        best = self.initial
        if self.verify_cost(self.initial + 1) is not None:
            best = max(range(1, self._longest_priced() + 1),
                       key=lambda k: (1 + model[k]) / (self.verify_cost(k + 1) + self.draft_forwards(k) * D))
        self._k = self._explored(best)
        self._width, self._from_text = self._k + 1, [False] * self.batch_size
        return [self._k] * self.batch_size

    def choose(self, text_lengths: list[int], forwards_without_model: int = 0) -> tuple[int, list[bool], int]:
        """This round's choice, given each row's text drafts (``text_lengths``: how many its
        match offers, 0 for none): (k, the model's drafts for the rows that take it, 0: the
        model does not draft; per row whether it drafts its text; the text chains' longest
        length). ``forwards_without_model``: the draft forwards the drafter runs in a round
        where the model drafts nothing (MTP layers catch up every round: 1; a feature head
        waits, :meth:`HeadDrafter.skip`: 0)."""
        self._tick()
        model, text = self._cumulative("model"), self._cumulative("text")
        offers = Counter(min(n, self.max_draft) for n in text_lengths)  # rows by the drafts their text offers
        D = self.draft_cost()
        known = self.verify_cost(self.initial + 1) is not None and (D is not None or not any(text_lengths))
        if len(self._chain_widths()) == 1 and self._narrowed < 2:  # the model alone at another width: the slope
            # (as soon as one width is timed: a head's first catch-up is no forward's cost, so D may be unknown)
            self._narrowed += 1  # twice at most: a tree's width first, then 2 tokens, then initial + 1
            k, cap, runs = self._narrowest(), 0, True
        elif not known:  # the first rounds: the text where it matches and the model, both to the initial k, timed
            k, cap, runs = min(self.initial, self._largest_k), self.initial, True
        else:
            best, plain, V = None, None, [None] + [self.verify_cost(w) for w in range(1, 2 + self.max_draft)]
            longest = self._longest_priced()
            for cap in [0] + sorted(n for n in offers if n > 0):  # 0: no text this round (its width may not pay)
                cut = Counter()
                for n, rows in offers.items():
                    cut[min(n, cap)] += rows
                for k in range(0, longest + 1):
                    tokens, widest, runs = 0.0, 0, False
                    for n, rows in cut.items():
                        if n > 0 and text[n] >= model[k]:
                            tokens, widest = tokens + rows * (1 + text[n]), max(widest, n)
                        else:
                            tokens, runs = tokens + rows * (1 + model[k]), runs or k > 0
                    forwards = max(self.draft_forwards(k), forwards_without_model) if runs else forwards_without_model
                    seconds = V[1 + max(widest, k if runs else 0)] + (D or 0.0) * forwards
                    rate = tokens / max(seconds, 1e-12)
                    if not runs and widest == 0:  # nothing drafts: a plain decode step
                        plain = rate, 0, 0, False
                    elif best is None or rate > best[0]:
                        best = rate, k if runs else 0, cap, runs
            # a plain step where it beats every draft, but not in the exploring rounds (nor before
            # PLAIN_AFTER rounds): acceptance is measured only where something drafts
            if (plain is not None and plain[0] > best[0] and self._rounds > self.PLAIN_AFTER
                    and self._rounds % self.explore_every):
                best = plain
            _, k, cap, runs = best
            if runs:
                k = self._explored(k)
        self._k = k if runs else 0
        self._from_text = [min(n, cap) > 0 and (not known or text[min(n, cap)] >= model[self._k])
                           for n in text_lengths]
        used = [min(n, cap) for n, u in zip(text_lengths, self._from_text) if u]
        self._width = 1 + max(used + [self._k])
        self._choice = self._k
        return self._k, self._from_text, max(used + [0])

    def observe(self, num_draft, num_accepted) -> None:
        for kind in ("model", "text"):
            reached, passed = self._runs[kind]
            for j in range(1, self.max_draft + 1):
                reached[j] *= self.forget_runs
                passed[j] *= self.forget_runs
        for n, a, from_text in zip(num_draft, num_accepted, self._from_text):
            self._count("text" if from_text else "model", n, a)
        if self.text:
            self.text_beside_draft.observe(num_draft, num_accepted)

    def _count(self, kind: str, n: int, a: int) -> None:
        """A run: of ``n`` drafts the first ``a`` accepted, draft a + 1 (if drafted) not."""
        reached, passed = self._runs[kind]
        for j in range(1, min(a + 1, n, self.max_draft) + 1):
            reached[j] += 1
            passed[j] += j <= a

    def observe_text(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """(The drafter, after :meth:`observe`.) What the text would have given the rows that
        drafted from the model this round, read off the tokens the target committed: of
        ``num_draft[b]`` text drafts that could be compared (the offer, cut to the committed
        tokens) the first ``num_accepted[b]`` equal them. Greedy, a deterministic draft is
        accepted exactly where it equals the target's token; sampling, with the chance that the
        target's sample equals it, so the comparison is an unbiased run in both. The text's
        estimate is then measured every round where it matches, not only where it drafts (a
        text that failed twice early was otherwise never drafted again in the call). A text
        draft past the first is compared only where the model's drafts before it were accepted
        (the target commits one token past them), so on easier text than the average; measured
        beside the head at B=8, the text's rows had 3.03 tokens a round expected and 3.38
        committed. Comparing the first draft alone lost most of the gain at B=1."""
        for n, a in zip(num_draft, num_accepted):
            if n > 0:
                self._count("text", n, a)

    def keep_rows(self, rows) -> None:
        if self._full_batch_costs is None and len(rows) < len(self._from_text):  # what the next call starts from
            self._full_batch_costs = {w: list(e) for w, e in self._widths.items()}, list(self._draft)
        super().keep_rows(rows)
        self._from_text = [self._from_text[r] for r in rows]
        if self.text:
            self.text_beside_draft.keep_rows(rows)
