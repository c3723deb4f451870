"""What a round costs on this device, by shape: the target's verification of ``rows`` x
``width`` tokens (measured as rounds run, or once by :func:`calibrate`) and the drafting
before it (by draft steps).

Measured costs are kept per shape, because the verification's cost is irregular in its
width (the weight-read regime of the bundled target, DESIGN.md section 6: 2 tokens 1.78x one
token, 5 tokens 1.37x, 8 tokens 1.28x): a shape measured is read back as measured, a shape
not yet measured is read from a least-squares line through the shapes measured with the
same number of rows (or, with one width measured so far, from all shapes: seconds =
a + b * rows * width). A shape's estimate is the low median of its last ``window``
measurements (of 1: it; of 2: the faster; of 3 or more: the middle one, the faster of the
two middle ones for an even count), so a loaded machine's occasional slow step (a stall
adds time, it never takes any away) does not move it, while a machine that stays slower
moves it within half a window. Each measured shape is then shrunk toward the line through
the shapes of its rows (weighted by their measurements), worth ``PULL`` = 3 measurements: a
width seldom verified, measured a few times on a loaded machine, reads mostly the line,
one verified every round mostly its own median. A shape not measured in the last ``STALE`` =
64 measurements reads the line through the fresh ones (and a drafting length likewise): a
width measured only while the machine was slow, and never chosen again because it seemed
dear, would otherwise stay dear for good.

Used by :class:`spec_ext.policies.Adaptive`; any policy can keep one (``record_*`` after
a timed round, ``verify``/``draft`` to plan the next).
"""
from __future__ import annotations

import time
import weakref

import torch


class StepCosts:
    """Seconds of a round's parts by shape on one device (see the module docstring).

    Args:
        window: how many recent measurements of each shape its estimate (their low median)
            reads (>= 1).
    """

    PULL = 3.0  # how many measurements the line through a shape's neighbours is worth in its estimate
    STALE = 64  # a shape last measured this many measurements (of its table) ago reads the fresh shapes' line

    def __init__(self, window: int = 9):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: must be an int >= 1, got {window!r}")
        self.window = window
        self._verify: dict[tuple[int, int], list] = {}  # (rows, width) -> [estimate, recent seconds]
        self._draft: dict[int, list] = {}  # draft steps -> [estimate, recent seconds]
        self._memo: dict[tuple, object] = {}  # verify()'s answers (and lines) since the last record_verify
        self._draft_memo: dict = {}  # draft()'s answers (and the line) since the last record_draft
        self._ticks = {"verify": 0, "draft": 0}  # measurements recorded so far, per table

    # ------------------------------------------------------------------ measurements
    def record_verify(self, rows: int, width: int, seconds: float) -> None:
        """One verification of ``rows`` rows of ``width`` tokens each (the root included) took ``seconds``."""
        self._record(self._verify, (rows, width), seconds, "verify")
        self._memo.clear()

    def record_draft(self, steps: int, seconds: float) -> None:
        """One round's drafting of ``steps`` sequential steps (a chain's length; 1 for one forward) took ``seconds``."""
        self._record(self._draft, steps, seconds, "draft")
        self._draft_memo.clear()

    def _record(self, table: dict, key, seconds: float, name: str) -> None:
        self._ticks[name] += 1
        entry = table.setdefault(key, [0.0, [], 0])
        entry[2] = self._ticks[name]  # when it was last measured
        recent = entry[1]
        recent.append(float(seconds))
        if len(recent) > self.window:
            del recent[0]
        entry[0] = sorted(recent)[(len(recent) - 1) // 2]  # the low median

    # ------------------------------------------------------------------ estimates
    def verify(self, rows: int, width: int) -> float | None:
        """Estimated seconds of verifying ``rows`` x ``width`` tokens; None before any measurement."""
        key = (rows, width)
        if key not in self._memo:
            self._memo[key] = self._estimate(rows, width)
        return self._memo[key]

    def _estimate(self, rows: int, width: int) -> float | None:
        """:meth:`verify`, computed: a measured shape's low median shrunk toward the line
        through the shapes of its rows (each weighted by its measurements), worth ``PULL``
        measurements; a shape not measured: that line (or the line over rows x width)."""
        fresh = self._ticks["verify"] - self.STALE
        if ("line", rows) not in self._memo:  # the fit once per rows until the next measurement
            same = [(w, e[0], len(e[1])) for (r, w), e in self._verify.items() if r == rows and e[2] > fresh]
            self._memo[("line", rows)] = _fit(same) if len(same) >= 2 else None
        fit = self._memo[("line", rows)]
        line = None if fit is None else max(0.0, fit[0] + fit[1] * width)
        entry = self._verify.get((rows, width))
        if entry is not None and entry[2] <= fresh and line is not None:  # stale: measured before a change of load
            return line
        if entry is not None:
            if line is None:
                return entry[0]
            n = len(entry[1])
            return (n * entry[0] + self.PULL * line) / (n + self.PULL)
        if line is not None:
            return line
        if not self._verify:
            return None
        points = [(r * w, e[0], 1) for (r, w), e in self._verify.items()]
        if len({x for x, _, _ in points}) < 2:  # one shape measured: the same seconds per forward
            return sum(m for _, m, _ in points) / len(points)
        return max(0.0, _line(points, rows * width))

    def draft(self, steps: int, sequential: bool = True) -> float | None:
        """Estimated seconds of drafting ``steps`` drafts; None before any measurement. With one
        length measured, a sequential drafter's other lengths cost its seconds per step, a
        block drafter's (``sequential`` False: every length one forward) its seconds."""
        if (steps, sequential) not in self._draft_memo:
            self._draft_memo[steps, sequential] = self._draft_estimate(steps, sequential)
        return self._draft_memo[steps, sequential]

    def _draft_estimate(self, steps: int, sequential: bool) -> float | None:
        fresh = self._ticks["draft"] - self.STALE
        entry = self._draft.get(steps)
        if entry is not None and (entry[2] > fresh or len(self._draft) == 1):
            return entry[0]
        if "line" not in self._draft_memo:  # the fit once until the next measurement
            points = [(s, e[0], 1) for s, e in self._draft.items() if e[2] > fresh] or \
                [(s, e[0], 1) for s, e in self._draft.items()]
            self._draft_memo["line"] = None if not points else (points[0][:2], None) if len(points) == 1 else \
                (None, _fit(points))
        if self._draft_memo["line"] is None:
            return None
        one, fit = self._draft_memo["line"]
        if one is not None:  # one length measured: its seconds per step (a block: per forward)
            s, m = one
            return m * steps / max(s, 1) if sequential else m
        return max(0.0, fit[0] + fit[1] * steps)

    @property
    def measured(self) -> int:
        """How many verification shapes have a measurement."""
        return len(self._verify)


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the weighted least-squares line through ``points`` (x, y, weight)."""
    n = sum(p[2] for p in points)
    mx = sum(p[2] * p[0] for p in points) / n
    my = sum(p[2] * p[1] for p in points) / n
    sxx = sum(p[2] * (p[0] - mx) ** 2 for p in points)
    slope = sum(p[2] * (p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx > 0 else 0.0
    return my - slope * mx, slope


def _line(points: list[tuple[float, float, float]], x: float) -> float:
    """The weighted least-squares line through ``points`` (x, y, weight) at ``x``."""
    intercept, slope = _fit(points)
    return intercept + slope * x


@torch.no_grad()
def calibrate(target, rows=(1,), widths=range(1, 17), context: int = 128, repeats: int = 5,
              costs: StepCosts | None = None) -> StepCosts:
    """Time the target's forward over ``rows`` x ``width`` new tokens after ``context`` cached
    ones, for every pair of ``rows`` and ``widths`` (fastest of ``repeats``, after one warm-up),
    on the target's own forward path (:func:`spec_ext.models.forward` over a SpecCache) and
    record them in ``costs`` (a new :class:`StepCosts` if None), which is returned. A one-off
    measurement before generating; rounds then refine it as they run."""
    from spec_ext.models import attention_implementation

    costs = StepCosts() if costs is None else costs
    widths = list(widths)
    if not widths or min(widths) < 1 or not rows or min(rows) < 1 or context < 1 or repeats < 1:
        raise ValueError(f"rows, widths, context, repeats: need positive values, got {rows}, {widths}, {context}, "
                         f"{repeats}")
    with attention_implementation(target):
        for B in rows:
            time_rows(target, costs, B, widths, context, repeats)
    return costs


@torch.no_grad()
def time_rows(target, costs: StepCosts, B: int, widths: list[int], context: int, repeats: int) -> None:
    """:func:`calibrate`'s timings of ``B`` rows, on the forward path in effect (inside
    ``generate``: the one its rounds verify with). Its random ids come from a generator of
    its own: the global random state, which a sampled call may draw from, is not touched."""
    from spec_ext.models import SpecCache, forward

    device = target.device
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator(device=device).manual_seed(0)
    cache = SpecCache.for_model(target, B, context + max(widths) + 1)
    ids = torch.randint(0, vocab, (B, context), device=device, generator=generator)
    forward(target, ids, cache, torch.arange(context, device=device).expand(B, -1))
    cache.advance([context] * B)
    for width in widths:
        new = torch.randint(0, vocab, (B, width), device=device, generator=generator)
        positions = context + torch.arange(width, device=device).expand(B, -1)
        best = float("inf")
        for _ in range(repeats + 1):
            started = time.perf_counter()
            logits = forward(target, new, cache, positions)
            float(logits[0, -1, 0])  # the host waits for the forward, as a round's sync does
            best = min(best, time.perf_counter() - started)
        costs.record_verify(B, width, best)


SAMPLED_WIDEST = 33  # the widest verification timed to price sampled rounds (wider ones read the line)
SAMPLED_ROWS = 256  # the most rows timed to price sampled rounds (a larger batch reads theirs)
_VERIFICATION_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {(rows, widest): costs}


def verification_costs(target, rows: int, widest: int) -> StepCosts:
    """The verification's cost on ``target`` of ``rows`` rows (at most ``SAMPLED_ROWS``) by
    width 1..``widest``, timed once per process (fastest of 2 after a warm-up, on the forward
    path in effect: inside ``generate``, the one its rounds take) and kept for the target's
    life: what prices a sampled call's rounds (:class:`~spec_ext.policies.Adaptive`,
    :class:`~spec_ext.policies.Auto`), so that a seed reproduces the output (a call's own
    timings would split its random stream into rounds by the machine's load). The policies
    read the shapes timed alone, as the call's rows finish too."""
    rows = min(rows, SAMPLED_ROWS)
    table = _VERIFICATION_COSTS.setdefault(target, {})
    if (rows, widest) not in table:
        costs = StepCosts()
        time_rows(target, costs, rows, list(range(1, widest + 1)), context=64, repeats=2)
        table[rows, widest] = costs
    return table[rows, widest]
