"""The default policy: per row and round, what drafts (the model, the row's own text, a suffix
cache of earlier requests, or nothing) and how far, to maximise expected tokens per second
from what it measures as it goes (``docs/auto.md``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from spec_ext.policies.base import Call, Controller, Offer, Policy, Report, RoundPlan, RoundState, Source, check, \
    register, renumbered
from spec_ext.policies.estimates import Acceptance, Costs, RowSpread, call_pricing, finish_rate
from spec_ext.policies.ngram import TextSettings
from spec_ext.policies.suffix import Suffix, match_kind


@register
@dataclass(frozen=True)
class Auto(Policy):
    """The default: before every round, per row, what drafts and how far, to maximise
    expected tokens per second from what it measures as it goes (``docs/auto.md``).

    What drafts: the model (a draft model, a feature head, a block drafter, MTP layers); with
    ``text=True`` each row's own text (:class:`~spec_ext.policies.NGram`'s matcher); under
    :class:`~spec_ext.policies.Suffix` the suffix cache's tree; or nothing (a plain decode
    step, what :class:`Plain` runs). A round is valued as tokens per second until the batch's
    slowest row is done, from acceptance counted per depth and source
    (:class:`~spec_ext.policies.estimates.Acceptance`) and round costs by width
    (:class:`~spec_ext.policies.estimates.Pricing`).

    Contracts: greedy output is the target's whatever is decided (the decisions follow
    measured timings); a sampled call prices its rounds by the engine's rounds timed once per
    process (:func:`~spec_ext.policies.estimates.round_costs`), so a seed reproduces its output
    in a process. Across calls (``accelerate`` keeps a memory) greedy calls start from the
    costs and the model's and the text's acceptance the earlier greedy calls measured; a
    sampled call reads and writes nothing.

    Args:
        max_draft: the model's largest k and the text's longest chain.
        initial: the model's k until a round's cost is known.
        prior_acceptance, prior_weight: the chance of a first draft before any round, and how
            many observations each depth's prior is worth.
        forget_runs: the weight old acceptance runs keep per round.
        explore_every: how often a round drafts off the best choice.
        text: also draft each row's own text (n-gram matches), where the drafter supports it.
    """
    PLAIN_AFTER: ClassVar[int] = 16  # first drafts measured before a plain step is weighed: else mostly the prior
    EXPLORE_SHARE: ClassVar[float] = 0.01  # of the plain steps' seconds, what drafting rounds between them may cost
    PLAIN_RUN: ClassVar[int] = 4  # once a plain step wins, steps before it is weighed again (weighing costs time)
    LONGEST_RUN: ClassVar[int] = 16  # runs double while plain steps keep winning, up to this
    SWITCH: ClassVar[float] = 1.05  # after plain steps, how much more a draft must give to be taken
    OPTIMISTIC: ClassVar[float | None] = 0.9  # a draft's chance where plain steps win before it is measured
    max_draft: int = 12
    initial: int = 4
    prior_acceptance: float = 0.5
    prior_weight: float = 1.0
    forget_runs: float = 0.99
    explore_every: int = 8
    text: bool = True

    def __post_init__(self):
        check(self.max_draft >= 1 and 1 <= self.initial <= self.max_draft, "max_draft, initial",
              f"need 1 <= initial <= max_draft, got {self.initial}, {self.max_draft}")
        check(0 < self.prior_acceptance < 1 and 0 < self.forget_runs <= 1, "prior_acceptance, forget_runs",
              f"need 0 < prior_acceptance < 1 and forget_runs in (0, 1], got {self.prior_acceptance}, "
              f"{self.forget_runs}")
        check(self.prior_weight > 0, "prior_weight", f"must be > 0, got {self.prior_weight}")
        check(self.explore_every >= 2, "explore_every", f"must be >= 2, got {self.explore_every}")

    def text_settings(self, has_model: bool) -> TextSettings | None:
        return TextSettings() if self.text and has_model else None

    def start(self, call: Call) -> Controller:
        return AutoController(self, call)


@dataclass
class _Round:
    """What :meth:`AutoController.observe` needs of a round it planned: per row the own text's
    chain it did not draft (compared with what was committed), and a cache row's kind and its
    verified nodes' probability sum; where it drafted in place of a cheaper plain step (to keep
    acceptance measured), that step's price."""
    unused: list[list[int]] = field(default_factory=list)
    cache: list[tuple | None] = field(default_factory=list)
    instead_of_plain: float | None = None
    behind: int = 0  # the committed tokens (all rows') the model's drafter had not read
    earns: float = 0.0  # (plain steps chosen over drafts) the drafting seconds each step earns


@dataclass
class ExploreCredit:
    """Seconds a greedy caller may spend drafting where plain steps are priced cheaper
    (``seconds``), and what such a round cost over a plain step (``cost``: the largest of the
    recent ones, each older one worth 0.8 of itself: the drafter's catch-up over the prompt or
    over the steps it skipped varies); kept across calls: a short call alone seldom earns one."""
    seconds: float = 0.0
    cost: float = 0.0

    def measured(self, extra: float) -> None:
        self.cost = max(extra, 0.8 * self.cost)

    def merged(self, other: "ExploreCredit") -> "ExploreCredit":
        return ExploreCredit(max(self.seconds, other.seconds), max(self.cost, other.cost))


class AutoController(Controller):
    """One call of :class:`Auto` (and of :class:`~spec_ext.policies.Suffix` beside a model:
    ``suffix`` offers its cache's trees)."""

    per_row = ("seen", "passed")

    def __init__(self, policy: Auto, call: Call, suffix: Suffix | None = None):
        super().__init__(policy, call)
        self.suffix = suffix
        fresh = lambda: Acceptance(policy.max_draft, policy.prior_acceptance, policy.prior_weight,  # noqa: E731
                                   policy.forget_runs)
        self.costs, model, text, self.spread, self.credit = self.recall(costs=Costs, model=fresh, text=fresh,
                                                                        rows=RowSpread, explore=ExploreCredit)
        self.accept = {Source.MODEL: model, Source.TEXT: text}
        # per row going: its model rows' first drafts and those accepted; rows done: their counts
        self.seen, self.passed = [0.0] * call.batch_size, [0.0] * call.batch_size
        self.done: list[tuple[float, float]] = []
        per_forward = call.drafts_per_forward
        self.largest = min(policy.max_draft, per_forward) if per_forward > 1 else policy.max_draft
        self.pricing = call_pricing(call, self.costs, self.largest, per_forward)
        self.rounds, self.k, self.narrowed = 0, policy.initial, 0
        self.run = 0  # the last plain run's planned steps (0: the last plan drafted)
        self.plain_left = (0, 0, 0.0)  # a plain run's steps not taken, at this many rows, each earning this

    # ------------------------------------------------------------------ estimates
    def survival(self, source: Source = Source.MODEL) -> list[float]:
        return self.accept[source].survival()

    def _chain_widths(self, rows: int) -> list[int]:
        widths = self.costs.widths(rows) if self.pricing.timed else []
        return [w for w in widths if w <= self.policy.max_draft + 1]

    def _one_width(self, rows: int) -> bool:
        """Whether one chain's width alone was timed at ``rows``, a drafting one (plain steps
        alone leave the slope to the line through the other batch sizes)."""
        widths = self._chain_widths(rows)
        return len(widths) == 1 and widths[0] > 1

    def _longest_priced(self) -> int:
        """The model's largest k this round: one past the deepest draft its rounds have reached
        (a chain grows a draft a round where the estimates say it pays, never onto depths
        priced by the prior alone)."""
        acc = self.accept[Source.MODEL]
        deepest = max((j for j in range(1, self.policy.max_draft + 1) if acc.reached[j] >= 0.5 * acc.unit), default=0)
        return max(1, min(self.largest, deepest + 1))

    def _explored(self, k: int) -> int:
        """``k``, or one more / one less in the exploring rounds (greedy, one less than one is a
        plain step: its cost stays measured beside the drafting rounds')."""
        every = self.policy.explore_every
        phase = self.rounds % (2 * every)
        step = 1 if phase == every else -1 if phase == 0 else 0
        return min(self.largest, max(0 if self.pricing.timed else 1, k + step))

    def _narrowest(self, rows: int) -> int:
        seen, = self._chain_widths(rows)
        return 1 if seen > 2 else min(self.largest, max(2, self.policy.initial))

    # ------------------------------------------------------------------ the round
    def _offers(self, state: RoundState) -> tuple[list[list[int]], list[tuple | None]]:
        """Per row its own text's chain ([] none) and the cache's offer ((offer, kind,
        curve) or None), curve[m] the expected accepted drafts of its best m nodes."""
        B, text = state.rows, state.text
        chains = [text.chain(r, self.policy.max_draft) for r in range(B)] if text is not None and self.policy.text \
            else [[] for _ in range(B)]
        trees: list[tuple | None] = [None] * B
        if self.suffix is not None and text is not None:
            for r in range(B):
                offer = self.suffix.cache_offer(text, r, B)
                if offer is None:
                    continue
                kind = match_kind(offer.match)
                share, curve = self.suffix.cache.expected(kind, 1.0), [0.0]
                for p in sorted(offer.probs, reverse=True):
                    curve.append(curve[-1] + share * p)
                trees[r] = offer, kind, curve
        return chains, trees

    def plan(self, state: RoundState) -> RoundPlan:
        self.rounds += 1
        B, policy = state.rows, self.policy
        left, rows, earns = self.plain_left
        if left and rows == B:  # (the engine took fewer steps of a plain run than planned, rows unchanged)
            self.k = 0
            return RoundPlan([0] * B, steps=left, record=_Round(earns=earns))
        chains, trees = self._offers(state)
        instead_of_plain, steps, earns = None, 1, 0.0
        model, own = self.accept[Source.MODEL].cumulative(), self.accept[Source.TEXT].cumulative()
        # per row its text's curve: expected accepted of m drafts, the better offer at each m
        curves = []
        for chain, tree in zip(chains, trees):
            n = min(len(chain), policy.max_draft)
            curve = own[:n + 1]
            if tree is not None:
                tc = tree[2]
                curve = [max(a, b) for a, b in zip(curve + [0.0] * (len(tc) - len(curve)),
                                                   tc + [0.0] * (len(curve) - len(tc)))]
            curves.append(curve)
        price = self.pricing
        # timed: once a chain's width at this batch size (rows finished: two at others, their line) and a
        # draft forward (where text competes) are measured
        tail = B < self.call.batch_size and self.costs.measured >= 2
        known = not price.timed or ((bool(self._chain_widths(B)) or tail) and
                                    (price.draft(1, B) is not None or not any(len(c) > 1 for c in curves)))
        wait = self.call.forwards_without_model
        if self._one_width(B) and self.narrowed < 2:  # the model alone at another width: the slope
            self.narrowed += 1
            k, cap, runs = self._narrowest(B), 0, True
        elif not known:  # the first rounds: the text where it matches and the model, both to the initial k, timed
            k, cap, runs = min(policy.initial, self.largest), policy.initial, True
        elif price.timed and not tail and 1 not in self._chain_widths(B):
            # then a plain step (no text either), timed once at a batch size a call starts at: the
            # line through the drafting widths prices one above its cost
            return RoundPlan([0] * B, record=_Round())
        else:
            V = [None] + [price.verify(B, w) for w in range(1, 2 + max(policy.max_draft, *map(len, curves)))]
            D = [price.draft(j, B) or 0.0 for j in range(self.largest + 1)]
            scales, remaining, shrink = [1.0] * B, state.remaining, None
            if remaining is not None:  # priced until the slowest row is done
                shrink = [1.0] * (B + 1)
                if B > 1:
                    scales = self.spread.scales(self.accept[Source.MODEL].chance(1), self.seen, self.passed)
                    one = price.verify(1, 1)
                    if one and V[1]:
                        shrink = [(one + (V[1] - one) * (b - 1) / (B - 1)) / V[1] for b in range(B + 1)]
            # a drafter behind the committed text (after plain steps; the prompt) reads it first, once
            catch_up = price.catch_up(sum(state.behind)) if state.behind and shrink else 0.0
            caps = {len(c) - 1 for c in curves if len(c) > 1}
            for tree in trees:  # a tree is cut to its best m nodes, any m
                if tree is not None:
                    caps.update(range(1, len(tree[2])))

            def weigh(model_curve):
                """(the best round that drafts, the best where the model drafts, the plain step),
                each (rate, k, cap, runs, seconds), the model's drafts valued by ``model_curve``."""
                best = by_model = plain = None
                for cap in [0] + sorted(caps):
                    values = [c[min(len(c) - 1, cap)] for c in curves]
                    used = [min(len(c) - 1, cap) for c in curves]
                    for k in range(0, self._longest_priced() + 1):
                        progress, widest, runs = [], 0, False
                        for value, m, scale in zip(values, used, scales):
                            if m > 0 and value >= model_curve[k]:
                                progress.append(1 + value)
                                widest = max(widest, m)
                            else:
                                progress.append(1 + min(k, model_curve[k] * scale))
                                runs = runs or k > 0
                        seconds = V[1 + max(widest, k if runs else 0)] + (D[k] if runs else wait * D[1])
                        rate = finish_rate(progress, remaining, seconds, shrink, catch_up if runs else 0.0) \
                            if shrink else sum(progress) / max(seconds, 1e-12)
                        option = rate, k if runs else 0, cap, runs, seconds
                        if not runs and widest == 0:
                            plain = option
                        elif best is None or rate > best[0]:
                            best = option
                        if runs and (by_model is None or rate > by_model[0]):
                            by_model = option
                return best, by_model, plain

            best, by_model, plain = weigh(model)
            # a plain step where it beats every draft (after plain steps, unless a draft beats it by
            # SWITCH: its estimates are noisy, and drafting at a batch of rows is dear where it is
            # wrong), once the model's acceptance rests on PLAIN_AFTER drafts (this call's rows'
            # and the memory's) or where it beats every draft accepted as often as OPTIMISTIC
            # says, but for a drafting round where the plain steps since the last one earned it
            # (EXPLORE_SHARE of their seconds): acceptance is measured only where something drafts
            margin = policy.SWITCH if self.k == 0 and self.rounds > 1 else 1.0
            sure = self.accept[Source.MODEL].first_drafts >= policy.PLAIN_AFTER
            if not sure and policy.OPTIMISTIC and best is not None and plain is not None and \
                    plain[0] * margin > best[0]:
                optimistic = [0.0]
                for j in range(1, len(model)):
                    optimistic.append(optimistic[-1] + policy.OPTIMISTIC ** j)
                drafting = weigh(optimistic)[0]
                sure = drafting is None or plain[0] * margin > drafting[0]
            if best is None:
                best = plain
            elif plain is not None and plain[0] * margin > best[0] and sure:
                # an exploring round is the model's: the text's acceptance is measured without drafting it
                priced = None if by_model is None else by_model[4] - plain[4] + catch_up  # (measured: with it)
                cost = None if priced is None else \
                    max(self.credit.cost, priced) if price.timed and self.credit.cost else 2 * priced
                if cost is None or self.credit.seconds < cost:
                    steps = min(2 * self.run, policy.LONGEST_RUN) if self.k == 0 and self.run else policy.PLAIN_RUN
                    best, earns = plain, policy.EXPLORE_SHARE * plain[4]
                else:
                    self.credit.seconds -= cost
                    best, instead_of_plain = by_model, plain[4]
            _, k, cap, runs, _ = best
            if runs and instead_of_plain is None:
                k = self._explored(k)
                if k == 0:  # (no text either; the next round is weighed as after this one's k)
                    return RoundPlan([0] * B, record=_Round())
        self.k = k if runs else 0
        self.run = steps if steps > 1 else 0
        text: list[Offer | None] = []
        record = _Round(instead_of_plain=instead_of_plain, behind=sum(state.behind or ()), earns=earns)
        for chain, tree, curve in zip(chains, trees, curves):
            m = min(len(curve) - 1, cap)
            offer = None
            if m > 0 and (not known or curve[m] >= model[self.k]):
                if tree is not None and tree[2][min(m, len(tree[2]) - 1)] >= own[min(m, len(chain))]:
                    offer = best_nodes(tree[0], min(m, len(tree[2]) - 1))
                    record.cache.append((tree[1], sum(offer.probs)))
                else:
                    offer = Offer(Source.TEXT, tuple(chain[:m]), match=0)
                    record.cache.append(None)
            else:
                record.cache.append(None)
            record.unused.append(chain if offer is None or offer.source != Source.TEXT else [])
            text.append(offer)
        # (while the costs are measured the model drafts beside the text rows too: its forwards are timed)
        k_rows = [self.k if t is None or not known else 0 for t in text]
        return RoundPlan(k_rows, text, steps=steps, record=record)

    def observe(self, report: Report) -> None:
        if report.explores:
            return
        rows, record = len(report.drafted), report.plan.record
        timed = self.pricing.timed and report.timed
        if timed:
            self.costs.record_round(report, 0 if record is None else record.behind, self.pricing.per_forward == 1)
        self.rounds += report.steps - 1  # (rounds count steps: a plain run's are rounds of the schedule)
        for _ in range(report.steps):
            for acceptance in self.accept.values():
                acceptance.new_round()
        if record is not None:
            self.credit.seconds += record.earns * report.steps
        # a plain run's steps the engine did not take (the call's first round; a drafter that runs
        # every round takes one step a plan) are planned without weighing, where no row finished
        left = report.plan.steps - report.steps if report.plan.plain else 0
        self.plain_left = left, rows, 0.0 if record is None else record.earns
        if record is not None and timed and record.instead_of_plain is not None:
            self.credit.measured(report.seconds - record.instead_of_plain)
        for r, (source, n, a) in enumerate(zip(report.source, report.drafted, report.accepted)):
            if source == Source.MODEL:
                self.accept[Source.MODEL].run(n, a)
                if n:
                    self.seen[r] += 1
                    self.passed[r] += a > 0
            elif source == Source.TEXT:
                self.accept[Source.TEXT].run(n, a)
            elif source == Source.CACHE and record is not None and record.cache[r] is not None:
                kind, score = record.cache[r]
                self.suffix.cache.calibrate(kind, a, score)
        if record is not None:  # what the text would have given where it did not draft
            for chain, committed in zip(record.unused, report.committed):
                n = min(len(chain), len(committed))
                if n:
                    self.accept[Source.TEXT].run(n, next((j for j in range(n) if chain[j] != committed[j]), n))

    def keep_rows(self, rows) -> None:
        kept = set(rows)
        self.done += [(n, a) for i, (n, a) in enumerate(zip(self.seen, self.passed)) if i not in kept]
        super().keep_rows(rows)

    def finish(self) -> None:
        counts = self.done + list(zip(self.seen, self.passed))
        self.spread.add([n for n, _ in counts], [a for _, a in counts])
        super().finish()


def best_nodes(offer: Offer, m: int) -> Offer:
    """``offer`` (a tree) cut to the root and its ``m`` likeliest nodes (ties: the earlier),
    renumbered in their order. A node is never likelier than its parent, so the kept nodes hold
    their parents (the ancestors of a kept node are kept in any case).

    Example:
        >>> cut = best_nodes(Offer(Source.CACHE, (-1, 5, 9, 6, 7), (-1, 0, 0, 1, 3), 2, (0.6, 0.4, 0.6, 0.3)), 2)
        >>> cut.tokens, cut.parents
        ((-1, 5, 6), (-1, 0, 1))
    """
    tokens, parents, probs = offer.tokens, offer.parents, offer.probs
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-probs[i - 1], i))[:max(0, m)]
    kept = set(ranked)
    for i in ranked:
        while parents[i] > 0 and parents[i] not in kept:
            i = parents[i]
            kept.add(i)
    order = sorted(kept)
    return Offer(offer.source, (-1,) + tuple(tokens[i] for i in order), tuple(renumbered(parents, order)),
                 offer.match, tuple(probs[i - 1] for i in order))
