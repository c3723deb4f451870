"""The estimates every measuring policy decides from (``Auto``, ``Adaptive``, ``Suffix``): what
a round costs on this device (:class:`Costs`, :class:`Pricing`) and how likely drafts are
accepted (:class:`Acceptance`). Each is a plain value
with ``merged(other)``, so a :class:`~spec_ext.policies.base.Memory` can keep it across calls.
Where each constant comes from: ``docs/auto.md`` and ``docs/adaptive.md``.
"""
from __future__ import annotations

import bisect
import functools
import math
import statistics
import threading
import time
import weakref

import torch

from spec_ext.policies.base import Call, Controller, Report, RoundPlan, RoundState

# upper edges of Acceptance's confidence bins
EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97)


class Costs:
    """Seconds of a round's parts by shape on one device: the target's verification of
    ``rows`` x ``width`` tokens, drafting ``rows`` rows by steps (a chain's sequential
    forwards, or the slots of a block drafter's one forward), one draft step by rows, a
    drafter's catch-up by tokens.

    A shape's estimate is the low median of its last ``window`` measurements (of 2: the
    faster; a stall adds time, it never takes any away), shrunk toward the weighted
    least-squares line through the shapes of its rows, worth ``PULL`` measurements (a width
    seldom measured reads mostly the line, one measured every round mostly its own); width 1,
    a plain step (none of a verification's machinery), stays off the line and reads its own
    once two wider widths of its rows are measured (the line then runs through those). A shape
    not measured reads that line (never below half the cheapest shape of its rows measured;
    with one shape of its rows measured: the line over rows x width through every shape; one
    shape in all: its seconds); one not measured in the last ``STALE`` measurements reads the
    line through the fresh ones (a width measured only while the machine was slow would
    otherwise stay dear for good). Drafting likewise by steps at its rows, without the pull:
    with one length measured, a sequential drafter's other lengths cost its seconds per step, a
    block's the same forward; at rows not measured, a forward (a sequential drafter's step) costs
    what the line through the measured batch sizes gives.
    """

    PULL = 3.0
    STALE = 64

    def __init__(self, window: int = 9):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: must be an int >= 1, got {window!r}")
        self.window = window
        self._verify: dict[tuple[int, int], list] = {}  # (rows, width) -> [estimate, recent seconds, tick]
        self._draft: dict[tuple[int, int], list] = {}  # (rows, steps) -> [estimate, recent seconds, tick]
        self._draft_step: dict[int, list] = {}  # rows -> [estimate, recent seconds, tick]
        self._catch_up: list[tuple[int, float]] = []  # recent (tokens, seconds), newest last
        self._ticks = {"verify": 0, "draft": 0, "draft_step": 0}
        self._memo: dict = {}  # answers since the last measurement

    def record_verify(self, rows: int, width: int, seconds: float) -> None:
        """One verification of ``rows`` rows of ``width`` tokens each (the root included) took ``seconds``."""
        self._record(self._verify, (rows, width), seconds, "verify")

    def record_draft(self, steps: int, seconds: float, rows: int = 1) -> None:
        """One round's drafting of ``steps`` steps for ``rows`` rows took ``seconds``."""
        self._record(self._draft, (rows, steps), seconds, "draft")

    def record_step(self, rows: int, seconds: float) -> None:
        """One draft step (a forward past a chain's first) of ``rows`` rows took ``seconds``."""
        self._record(self._draft_step, rows, seconds, "draft_step")

    def step(self, rows: int) -> float | None:
        """Estimated seconds of one draft step of ``rows`` rows; None before any measurement."""
        entry = self._draft_step.get(rows)
        return None if entry is None else entry[0]

    def record_catch_up(self, tokens: int, seconds: float) -> None:
        """A drafter's catch-up over ``tokens`` committed tokens it had not seen (all rows'
        together), past its round's draft steps, took ``seconds``."""
        self._catch_up = [*self._catch_up, (tokens, float(seconds))][-self.window:]
        self._memo.pop("catch_up", None)

    def catch_up(self, tokens: int) -> float:
        """Estimated seconds of a drafter's catch-up over ``tokens`` committed tokens (all rows'
        together): the line through the recent catch-ups by tokens (a part per forward and one
        per token, neither below 0: one forward reads a long prompt at less per token than a
        few skipped steps); with one count of tokens measured, its median seconds per token;
        0 before any measurement."""
        if "catch_up" not in self._memo:
            points = self._catch_up
            if len({n for n, _ in points}) < 2:
                per_token = sorted(s / n for n, s in points)[(len(points) - 1) // 2] if points else 0.0
                self._memo["catch_up"] = 0.0, per_token
            else:
                intercept, slope = _fit([(n, s, 1) for n, s in points])
                if slope < 0:  # (noise) the mean
                    intercept, slope = sum(s for _, s in points) / len(points), 0.0
                elif intercept < 0:  # the line through the origin
                    intercept, slope = 0.0, sum(s for _, s in points) / sum(n for n, _ in points)
                self._memo["catch_up"] = intercept, slope
        intercept, slope = self._memo["catch_up"]
        return intercept + slope * tokens if tokens else 0.0

    def record_round(self, report, behind: int, sequential: bool = True) -> None:
        """A timed round's parts (``report``: a :class:`~spec_ext.policies.base.Report`): its
        verification (the round's seconds past its draft forwards) by rows and width; its
        drafting by steps where the forwards were warm, else the catch-up over ``behind``
        (:meth:`record_cold`)."""
        self.record_verify(len(report.drafted), report.width, max(report.seconds - report.draft_seconds, 0.0))
        if report.draft_forwards and report.warm:
            self.record_draft(report.draft_steps, report.draft_seconds, len(report.drafted))
        else:
            self.record_cold(report, behind, sequential)

    def record_cold(self, report, behind: int, sequential: bool = True) -> None:
        """Of a round whose draft forwards first read ``behind`` committed tokens the drafter
        had not (all rows'), the catch-up: the forwards' seconds past what their steps cost
        (once those are measured; ``sequential``: a chain's forwards, else a block's)."""
        if report.draft_forwards and not report.warm and behind:
            steps = self.draft(report.draft_steps, sequential, len(report.drafted))
            if steps is not None:
                self.record_catch_up(behind, max(report.draft_seconds - steps, 0.0))

    def _record(self, table: dict, key, seconds: float, name: str) -> None:
        self._ticks[name] += 1
        entry = table.setdefault(key, [0.0, [], 0])
        entry[2] = self._ticks[name]
        entry[1].append(float(seconds))
        del entry[1][:-self.window]
        entry[0] = sorted(entry[1])[(len(entry[1]) - 1) // 2]
        if name in ("verify", "draft"):  # what the memo answers from
            self._memo.clear()

    @property
    def measured(self) -> int:
        """How many verification shapes have a measurement."""
        return len(self._verify)

    def widths(self, rows: int) -> list[int]:
        """The widths measured at ``rows``."""
        return sorted(w for r, w in self._verify if r == rows)

    def verify(self, rows: int, width: int) -> float | None:
        """Estimated seconds of verifying ``rows`` x ``width`` tokens; None before any measurement."""
        key = ("verify", rows, width)
        if key not in self._memo:
            self._memo[key] = self._verify_estimate(rows, width)
        return self._memo[key]

    def _verify_estimate(self, rows: int, width: int) -> float | None:
        fresh = self._ticks["verify"] - self.STALE
        if ("line", rows) not in self._memo:
            same = [(w, e[0], len(e[1])) for (r, w), e in self._verify.items() if r == rows and e[2] > fresh]
            wide = [point for point in same if point[0] > 1]
            # width 1 is a plain step, which runs none of a verification's machinery: below the line
            # of the widths that verify drafts, where two of them are measured
            self._memo["line", rows] = _fit(wide) if len(wide) >= 2 else _fit(same) if len(same) >= 2 else None
            self._memo["apart", rows] = len(wide) >= 2
        if width == 1 and self._memo["apart", rows] and (rows, 1) in self._verify:
            return self._verify[rows, 1][0]
        fit = self._memo["line", rows]
        if ("floor", rows) not in self._memo:  # a line never prices a width below half the cheapest measured
            self._memo["floor", rows] = 0.5 * min((e[0] for (r, _), e in self._verify.items() if r == rows),
                                                  default=0.0)
        line = None if fit is None else max(self._memo["floor", rows], fit[0] + fit[1] * width)
        entry = self._verify.get((rows, width))
        if entry is not None and (line is None or entry[2] > fresh):
            n = len(entry[1])
            return entry[0] if line is None else (n * entry[0] + self.PULL * line) / (n + self.PULL)
        if line is not None:
            return line
        if not self._verify:
            return None
        points = [(r * w, e[0], 1) for (r, w), e in self._verify.items()]
        if len({x for x, _, _ in points}) < 2:
            return sum(m for _, m, _ in points) / len(points)
        intercept, slope = _fit(points)
        return max(0.0, intercept + slope * rows * width)

    def draft(self, steps: int, sequential: bool = True, rows: int = 1) -> float | None:
        """Estimated seconds of drafting ``steps`` steps for ``rows`` rows; None before any measurement."""
        key = ("draft", steps, sequential, rows)
        if key not in self._memo:
            self._memo[key] = self._draft_estimate(steps, sequential, rows)
        return self._memo[key]

    def _draft_estimate(self, steps: int, sequential: bool, rows: int) -> float | None:
        fresh = self._ticks["draft"] - self.STALE
        entry = self._draft.get((rows, steps))
        if entry is not None and (entry[2] > fresh or len(self._draft) == 1):
            return entry[0]
        if not self._draft:
            return None
        measured = {key: e[0] for key, e in self._draft.items() if e[2] > fresh} or \
            {key: e[0] for key, e in self._draft.items()}
        mine = [(s, m, 1) for (r, s), m in measured.items() if r == rows] or \
            [(s, e[0], 1) for (r, s), e in self._draft.items() if r == rows]
        if len(mine) >= 2:
            intercept, slope = _fit(mine)
            return max(0.0, intercept + slope * steps)
        if mine:
            s, m, _ = mine[0]
            return m * steps / max(s, 1) if sequential else m
        # a forward (a sequential drafter's step) at the batch sizes measured, on their line
        points = [(r, m / max(s, 1) if sequential else m, 1) for (r, s), m in measured.items()]
        intercept, slope = _fit(points)
        forward = max(0.5 * min(y for _, y, _ in points), intercept + slope * rows)
        return forward * steps if sequential else forward

    def merged(self, other: "Costs") -> "Costs":
        """Both calls' measurements: per shape the newer ones of each, interleaved."""
        out = Costs(self.window)
        for name, mine, theirs, into in (("verify", self._verify, other._verify, out._verify),
                                         ("draft", self._draft, other._draft, out._draft),
                                         ("draft_step", self._draft_step, other._draft_step, out._draft_step)):
            for key in mine.keys() | theirs.keys():
                a, b = mine.get(key, [0, [], 0])[1], theirs.get(key, [0, [], 0])[1]
                recent = _interleave(a, b)
                for seconds in recent[-self.window:]:
                    out._record(into, key, seconds, name)
        out._catch_up = _interleave(self._catch_up, other._catch_up)[-self.window:]
        return out


def _interleave(a: list[float], b: list[float]) -> list[float]:
    """The two lists' items, newest last, taken alternately from their ends."""
    out, i, j = [], len(a), len(b)
    while i or j:
        if i:
            i -= 1
            out.append(a[i])
        if j:
            j -= 1
            out.append(b[j])
    return out[::-1]


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the weighted least-squares line through ``points`` (x, y, weight)."""
    n = sum(p[2] for p in points)
    mx = sum(p[2] * p[0] for p in points) / n
    my = sum(p[2] * p[1] for p in points) / n
    sxx = sum(p[2] * (p[0] - mx) ** 2 for p in points)
    slope = sum(p[2] * (p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx > 0 else 0.0
    return my - slope * mx, slope


class Pricing:
    """What a call's rounds cost, as its policy prices them. Greedy (``timed``): ``costs`` as
    measured (None until measured). Sampled (untimed, so that a seed reproduces the output
    whatever the machine's load): ``costs`` if it holds measurements given before the call
    (not updated), else ``modeled``: the rounds at ``modeled_rows`` rows as the engine runs
    them, timed once per process (:func:`round_costs`; None: one target step whatever the
    width, and a draft forward at ``size_ratio`` of it, the draft's share of the target's
    parameters: decoding reads every weight once per step). ``per_forward``: drafts one forward
    proposes (a block drafter's block: any length costs one forward)."""

    def __init__(self, costs: Costs, timed: bool, size_ratio: float = 0.1, per_forward: int = 1,
                 modeled: Costs | None = None, modeled_rows: int = 1):
        self.costs, self.timed, self.size_ratio, self.per_forward = costs, timed, size_ratio, per_forward
        self.modeled, self.modeled_rows = modeled, modeled_rows

    def _measured(self, rows: int) -> tuple[Costs | None, int]:
        """The costs that price the call's rounds, and at how many rows."""
        if self.timed or self.costs.measured:
            return self.costs, rows
        return self.modeled, self.modeled_rows

    def verify(self, rows: int, width: int) -> float | None:
        """Seconds (untimed: as modeled) of verifying ``rows`` x ``width`` tokens; None
        before a timed call measured any."""
        costs, rows = self._measured(rows)
        return 1.0 if costs is None else costs.verify(rows, width)

    def draft(self, steps: int, rows: int = 1) -> float | None:
        """Seconds (untimed: as modeled) of drafting ``steps`` drafts for ``rows`` rows."""
        costs, at = self._measured(rows)
        seconds = None if costs is None else costs.draft(steps, sequential=self.per_forward == 1, rows=at)
        if seconds is not None or self.timed:
            return seconds
        forwards = -(-steps // self.per_forward)
        return forwards * self.size_ratio * (self.verify(rows, 1) or 1.0)

    def catch_up(self, tokens: int) -> float:
        """Seconds (untimed: as modeled) of the drafter's catch-up over ``tokens`` committed
        tokens (all rows') it has not read; 0 where none was measured."""
        costs, _ = self._measured(1)
        return 0.0 if costs is None else costs.catch_up(tokens)


SAMPLED_ROWS = 256  # the most rows timed to price sampled rounds (a larger batch reads theirs)


def call_pricing(call, costs: Costs, largest: int, per_forward: int) -> Pricing:
    """A call's :class:`Pricing` (``call``: a :class:`~spec_ext.policies.base.Call`). Greedy:
    ``costs`` as measured. Sampled, unless ``costs`` holds measurements given before the call:
    its rounds of up to ``largest`` drafts a row as the engine runs them, timed once per process
    (:func:`round_costs`), so that a seed reproduces the output in a process (a tensor-parallel
    target's followers replay its forwards: nothing is timed there)."""
    from spec_ext.models.cache import split_size

    target, rows = call.target, min(call.batch_size, SAMPLED_ROWS)
    modeled = None
    if not call.greedy and not costs.measured and call.time_rounds is not None and split_size(target) == 1:
        modeled = round_costs(call, timing_schedule(largest), per_forward == 1)
    return Pricing(costs, call.greedy, size_ratio(target, call.draft), per_forward, modeled, rows)


def size_ratio(target, draft) -> float:
    """The draft's share of the target's parameters (at least 0.02; 0.1 without models)."""
    if target is None or draft is None:
        return 0.1
    size = sum(p.numel() for p in target.parameters())
    return max(0.02, sum(p.numel() for p in draft.parameters()) / size) if size else 0.1


class Acceptance:
    """How likely drafts are accepted: by depth (the chance that draft j is accepted once
    drafts 1..j-1 were), and, with ``bins``, by the drafter's confidence.

    By depth: draft 1's rate with ``weight`` observations of ``prior``; past it, the pooled
    rate of every draft past the first (with draft 1's rate as its prior) is the prior of
    each depth's own rate. So a depth rarely reached is priced like the drafts after an
    accepted one, and bursty acceptance (runs on easy text, none on hard) is valued as it
    is: j drafts yield ``1 + sum_{i<=j} S(i)`` tokens, S(i) the chance the first i all pass.

    By confidence (``bins``): a draft's chance is its confidence bin's rate in its depth
    class (right after the root, or after an accepted draft: acceptance is bursty) shrunk
    toward the class's pooled rate, past depth 1 scaled by how that depth's drafts fared
    against what their bins predicted (so a block drafter's weaker later slots are priced as
    they are, without counting their lower confidences twice).

    Each round (:meth:`new_round`) older observations weigh ``forget`` times less: the sums
    are kept in units of the newest round's weight, which grows, so forgetting touches no sum.
    """

    def __init__(self, depths: int, prior: float = 0.5, weight: float = 1.0, forget: float = 0.99,
                 bins: bool = False):
        self.depths, self.prior, self.weight, self.forget, self.bins = depths, prior, weight, forget, bins
        self.reached = [0.0] * (depths + 1)  # [d]: drafts at depth d verified with every draft before them accepted
        self.passed = [0.0] * (depths + 1)
        nb = len(EDGES) + 1
        self.bin_reached = [[0.0] * nb for _ in range(2)]  # [depth class][bin]
        self.bin_passed = [[0.0] * nb for _ in range(2)]
        self.depth_bins = [[0.0] * nb for _ in range(depths + 1)]  # [d][bin]: drafts reached
        self.first_drafts = 0  # first drafts ever observed (none forgotten): what the estimate has seen
        self.unit = 1.0
        self._cache = None

    def new_round(self) -> None:
        if self.forget < 1:
            self.unit /= self.forget
            if self.unit > 1e100:
                self._rescale()
        self._cache = None

    def _rescale(self) -> None:
        u = self.unit
        self.reached = [x / u for x in self.reached]
        self.passed = [x / u for x in self.passed]
        for table in (self.bin_reached, self.bin_passed, self.depth_bins):
            table[:] = [[x / u for x in row] for row in table]
        self.unit = 1.0

    def add(self, depth: int, passed: bool, confidence: float | None = None) -> None:
        """One draft at ``depth`` reached with every draft before it accepted: ``passed`` or not."""
        d = min(depth, self.depths)
        self.first_drafts += d == 1
        self.reached[d] += self.unit
        self.passed[d] += self.unit * passed
        if self.bins and confidence is not None:
            b, c = bisect.bisect_left(EDGES, confidence), min(depth, 2) - 1
            self.bin_reached[c][b] += self.unit
            self.bin_passed[c][b] += self.unit * passed
            self.depth_bins[d][b] += self.unit
        self._cache = None

    def run(self, drafted: int, accepted: int) -> None:
        """A chain of ``drafted`` drafts of which the first ``accepted`` passed, the next (if
        drafted) did not."""
        for j in range(1, min(accepted + 1, drafted, self.depths) + 1):
            self.add(j, j <= accepted)

    def _tables(self):
        if self._cache is None:
            w = self.weight * self.unit
            first = (self.passed[1] + w * self.prior) / (self.reached[1] + w)
            later = (sum(self.passed[2:]) + w * first) / (sum(self.reached[2:]) + w)
            chance = [first, first] + [(p + w * later) / (r + w) for r, p in zip(self.reached[2:], self.passed[2:])]
            table = scale = None
            if self.bins:
                table = [[(p + w * m) / (r + w) for r, p in zip(reached, passed)]
                         for reached, passed, m in zip(self.bin_reached, self.bin_passed, (first, later))]
                predicted = [sum(n * t for n, t in zip(bins, table[1])) for bins in self.depth_bins[2:]]
                scale = [1.0, 1.0] + [(p + w * later) / (e + w * later) for p, e in zip(self.passed[2:], predicted)]
            self._cache = chance, table, scale
        return self._cache

    def chance(self, depth: int) -> float:
        """The chance that a draft at ``depth`` is accepted once the drafts before it were."""
        return self._tables()[0][min(max(depth, 1), self.depths)]

    def survival(self) -> list[float]:
        """[S(1), ..., S(depths)]: the chance that drafts 1..j are all accepted."""
        out, alive = [], 1.0
        for j in range(1, self.depths + 1):
            alive *= self.chance(j)
            out.append(alive)
        return out

    def cumulative(self) -> list[float]:
        """[j]: the expected accepted drafts of a chain of j (index 0: 0)."""
        out = [0.0]
        for s in self.survival():
            out.append(out[-1] + s)
        return out

    def acceptance(self, confidence: float, depth: int = 1) -> float:
        """(``bins``) The chance that a draft of this confidence at this depth is accepted
        once the drafts before it were; at most 1."""
        _, table, scale = self._tables()
        d = min(max(depth, 1), self.depths)
        return min(1.0, table[min(d, 2) - 1][bisect.bisect_left(EDGES, confidence)] * scale[d])

    def merged(self, other: "Acceptance") -> "Acceptance":
        """Both calls' observations, averaged (each holds what they both read at their start)."""
        out = Acceptance(self.depths, self.prior, self.weight, self.forget, self.bins)
        a, b = self.unit, other.unit

        def mean(x, y):
            return [(u / a + v / b) / 2 for u, v in zip(x, y)]
        out.reached, out.passed = mean(self.reached, other.reached), mean(self.passed, other.passed)
        out.first_drafts = max(self.first_drafts, other.first_drafts)
        for name in ("bin_reached", "bin_passed", "depth_bins"):
            setattr(out, name, [mean(x, y) for x, y in zip(getattr(self, name), getattr(other, name))])
        return out


class RowSpread:
    """How much the rows of a batch differ in how often their first draft is accepted (their
    prompts differ: a hard one's drafts are refused more): the variance of the rows' own rates
    across rows, net of the counting noise, and how many rows it rests on (``rows``). Learned
    at the end of a call from its rows' counts (:meth:`add`), kept across calls.

    It prices a batch's rounds by its slow rows (:meth:`scales`): a batch's call lasts until its
    slowest row is done, so drafting that pays on the average row can lose where one row
    accepts little."""

    PRIOR_SD = 0.1  # before any batch is measured
    PRIOR_ROWS = 4.0
    MOST_ROWS = 64.0  # the most rows the estimate rests on (older batches' weight is capped)
    MIN_DRAFTS = 4  # a row's first drafts before its rate counts

    def __init__(self, variance: float = PRIOR_SD ** 2, rows: float = PRIOR_ROWS):
        self.variance, self.rows = variance, rows

    def add(self, seen: list[float], passed: list[float]) -> None:
        """One batch's rows: first drafts ``seen`` and ``passed`` per row."""
        counted = [(n, a) for n, a in zip(seen, passed) if n >= self.MIN_DRAFTS]
        if len(counted) < 2:
            return
        rates = [a / n for n, a in counted]
        mean = sum(rates) / len(rates)
        noise = sum(mean * (1 - mean) / n for n, _ in counted) / len(counted)
        variance = max(0.0, statistics.variance(rates) - noise)
        total = self.rows + len(counted)
        self.variance = (self.variance * self.rows + variance * len(counted)) / total
        self.rows = min(total, self.MOST_ROWS)

    def scales(self, chance: float, seen: list[float], passed: list[float]) -> list[float]:
        """Per row, the factor on the pool's acceptance its drafts are priced at, for a pool
        whose first draft passes with ``chance``: the row's own rate (its counts ``seen``,
        ``passed`` on a prior of the pool's rate and this spread), moved by its remaining
        uncertainty to the expected order statistic of its rank among the batch's rows (rows
        with no counts spread as the batch's rows do, the slowest priced below the pool)."""
        p = min(max(chance, 1e-3), 1 - 1e-3)
        strength = max(1.0, p * (1 - p) / max(self.variance, 1e-6) - 1)
        means = [(a + strength * p) / (n + strength) for n, a in zip(seen, passed)]
        order = sorted(range(len(means)), key=means.__getitem__)
        out = [1.0] * len(means)
        for z, r in zip(normal_order(len(means)), order):
            sd = math.sqrt(means[r] * (1 - means[r]) / (seen[r] + strength + 1))
            out[r] = min(max(means[r] + z * sd, 0.0), 1.0) / p
        return out

    def merged(self, other: "RowSpread") -> "RowSpread":
        total = self.rows + other.rows
        return RowSpread((self.variance * self.rows + other.variance * other.rows) / total,
                         min(total, self.MOST_ROWS))


@functools.lru_cache(maxsize=512)
def normal_order(n: int) -> tuple[float, ...]:
    """The expected order statistics of ``n`` standard normal draws, ascending (Blom's)."""
    if n == 1:
        return (0.0,)
    normal = statistics.NormalDist()
    return tuple(normal.inv_cdf((i + 0.625) / (n + 0.25)) for i in range(n))


def finish_rate(progress: list[float], remaining: list[int], seconds: float, shrink: list[float],
                once: float = 0.0) -> float:
    """Tokens per second over the rest of a call whose every round costs ``seconds`` with
    all its rows going, plus ``once`` seconds now: row r has ``remaining[r]`` tokens left and
    gains ``progress[r]`` a round, so it leaves after ``remaining[r] / progress[r]`` rounds (at
    least one), and a round with b rows going costs ``shrink[b]`` times a full one. One row,
    nothing once: ``progress / seconds``."""
    rounds = sorted(max(1.0, n / g) for n, g in zip(remaining, progress))
    total, before, B = 0.0, 0.0, len(rounds)
    for i, r in enumerate(rounds):
        total += (r - before) * shrink[B - i]
        before = r
    return sum(remaining) / max(total * seconds + once, 1e-12)


@torch.no_grad()
def calibrate(target, rows=(1,), widths=range(1, 17), context: int = 128, repeats: int = 5,
              costs: Costs | None = None) -> Costs:
    """Time the target's forward over ``rows`` x ``width`` new tokens after ``context`` cached
    ones, for every pair of ``rows`` and ``widths`` (fastest of ``repeats``, after one warm-up),
    on the target's own forward path (:func:`spec_ext.models.forward` over a SpecCache) and
    record them in ``costs`` (a new :class:`Costs` if None), which is returned: a one-off
    measurement before generating (``Adaptive(costs=...)``); rounds then refine it."""
    from spec_ext.models import attention_implementation

    costs = Costs() if costs is None else costs
    widths = list(widths)
    if not widths or min(widths) < 1 or not rows or min(rows) < 1 or context < 1 or repeats < 1:
        raise ValueError(f"rows, widths, context, repeats: need positive values, got {rows}, {widths}, {context}, "
                         f"{repeats}")
    with attention_implementation(target):
        for B in rows:
            time_rows(target, costs, B, widths, context, repeats)
    return costs


@torch.no_grad()
def time_rows(target, costs: Costs, B: int, widths: list[int], context: int, repeats: int) -> None:
    """:func:`calibrate`'s timings of ``B`` rows, on the forward path in effect: every width once
    per pass, the fastest of the passes, no width priced above a wider one. Its random ids come
    from a generator of its own: the global random state is not touched."""
    from spec_ext.models import SpecCache, forward

    device = target.device
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator(device=device).manual_seed(0)
    cache = SpecCache.for_model(target, B, context + max(widths) + 1)
    ids = torch.randint(0, vocab, (B, context), device=device, generator=generator)
    forward(target, ids, cache, torch.arange(context, device=device).expand(B, -1))
    cache.advance([context] * B)
    widths = sorted(set(widths))
    inputs = [(torch.randint(0, vocab, (B, w), device=device, generator=generator),
               context + torch.arange(w, device=device).expand(B, -1)) for w in widths]
    best = [float("inf")] * len(widths)
    for _ in range(repeats + 1):  # each pass times every width: a slow spell slows them all, not one
        for i, (new, positions) in enumerate(inputs):
            started = time.perf_counter()
            logits = forward(target, new, cache, positions).logits
            float(logits[0, -1, 0])  # the host waits for the forward, as a round's sync does
            best[i] = min(best[i], time.perf_counter() - started)
    for i in reversed(range(len(widths) - 1)):  # a narrower forward costs no more than a wider one
        best[i] = min(best[i], best[i + 1])
    for width, seconds in zip(widths, best):
        costs.record_verify(B, width, seconds)


def timing_schedule(largest: int) -> tuple[int, ...]:
    """The rounds :func:`round_costs` times, as the model's k per round (0: a plain run):
    a round to warm up, then twice each chain length up to ``largest`` that prices the others
    (their line), each time followed by plain runs (one, then three) and a round that catches
    up over them."""
    lengths = (*[k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if k < largest], largest)
    return (1, *lengths, 0, 1, *lengths, 0, 0, 0, 1)


class TimedSchedule(Controller):
    """The controller of ``schedule``'s rounds for every row of ``rows`` (a plain step runs as
    a run of ``PLAIN_RUN``), each timed round recorded into ``costs``
    (:meth:`Costs.record_round`; the catch-ups, the prompt's too, once the schedule's draft
    steps are measured); ``tokens``: the most a row emits; ``done``: the last round was
    observed."""

    PLAIN_RUN = 4

    def __init__(self, rows: int, schedule: tuple[int, ...], costs: Costs, sequential: bool):
        super().__init__(None, Call(rows, greedy=False))
        self.schedule, self.costs, self.sequential = schedule, costs, sequential
        self.planned, self.done = 0, False
        self.tokens = sum(k + 1 if k else self.PLAIN_RUN for k in schedule)
        self.cold: list[tuple[Report, int]] = []  # rounds whose drafter first caught up, and over how much

    def plan(self, state: RoundState) -> RoundPlan:
        k = self.schedule[min(self.planned, len(self.schedule) - 1)]
        self.planned += 1
        return RoundPlan([k] * state.rows, steps=1 if k else self.PLAIN_RUN, record=sum(state.behind or ()))

    def observe(self, report: Report) -> None:
        if report.timed and not report.explores:  # (the first round's forward also read the prompt)
            self.costs.record_round(report, 0, self.sequential)
        if report.draft_forwards and not report.warm:
            self.cold.append((report, report.plan.record))
        self.done = self.planned >= len(self.schedule)
        if self.done:
            for report, behind in self.cold:
                self.costs.record_cold(report, behind, self.sequential)
            self.cold = []


_ROUND_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {draft or None: {key: costs}}
_TIMING = threading.Lock()


def round_costs(call, schedule: tuple[int, ...], sequential: bool) -> Costs:
    """The cost of ``call``'s rounds (a :class:`~spec_ext.policies.base.Call` whose engine
    times rounds) at its batch size (at most ``SAMPLED_ROWS``): ``schedule``'s rounds
    (:class:`TimedSchedule`) run by the engine on random ids, timed once per process for the
    target, the draft and the sampling's settings, and kept for the models' lives, under a lock
    (calls on other threads wait for the one timing): what prices a sampled call's rounds, so
    that a seed reproduces the output (a call's own timings would split its random stream
    into rounds by the machine's load)."""
    rows = min(call.batch_size, SAMPLED_ROWS)
    key = rows, schedule, sequential, call.time_rounds.key
    with _TIMING:
        by_draft = _ROUND_COSTS.setdefault(call.target, {})
        draft = call.draft
        table = by_draft.setdefault(None, {}) if draft is None else \
            by_draft.setdefault("drafts", weakref.WeakKeyDictionary()).setdefault(draft, {})
        if key not in table:
            costs = Costs()
            call.time_rounds(TimedSchedule(rows, schedule, costs, sequential), rows)
            table[key] = costs
        return table[key]
