"""What a round costs on this device, by shape: the target's verification of ``rows`` x
``width`` tokens (measured as rounds run, or once by :func:`calibrate`) and the drafting
before it (a + b * draft steps).

Measured costs are kept per shape, because the verification's cost is irregular in its
width (the weight-read regime of the bundled target, DESIGN.md section 6: 2 tokens 1.78x one
token, 5 tokens 1.37x, 8 tokens 1.28x): a shape measured is read back as measured, a shape
not yet measured is read from a least-squares line through the shapes measured with the
same number of rows (or, with one width measured so far, from all shapes: seconds =
a + b * rows * width). Each shape's estimate forgets at rate ``forget`` per new measurement
of it, and a measurement over 3x its shape's estimate (the machine stalled) counts as 3x.

Used by :class:`spec_ext.policies.Adaptive`; any policy can keep one (``record_*`` after
a timed round, ``verify``/``draft`` to plan the next).
"""
from __future__ import annotations

import time

import torch


class StepCosts:
    """Seconds of a round's parts by shape on one device (see the module docstring).

    Args:
        forget: the weight an old measurement of a shape keeps per new one (in (0, 1]).
    """

    def __init__(self, forget: float = 0.8):
        if not 0 < forget <= 1:
            raise ValueError(f"forget: must be in (0, 1], got {forget}")
        self.forget = forget
        self._verify: dict[tuple[int, int], list[float]] = {}  # (rows, width) -> [weight, mean seconds]
        self._draft: dict[int, list[float]] = {}  # draft steps -> [weight, mean seconds]

    # ------------------------------------------------------------------ measurements
    def record_verify(self, rows: int, width: int, seconds: float) -> None:
        """One verification of ``rows`` rows of ``width`` tokens each (the root included) took ``seconds``."""
        self._record(self._verify, (rows, width), seconds)

    def record_draft(self, steps: int, seconds: float) -> None:
        """One round's drafting of ``steps`` sequential steps (a chain's length; 1 for one forward) took ``seconds``."""
        self._record(self._draft, steps, seconds)

    def _record(self, table: dict, key, seconds: float) -> None:
        weight, mean = table.get(key, (0.0, 0.0))
        if weight:
            seconds = min(seconds, 3 * mean)
        weight = self.forget * weight
        table[key] = [weight + 1, (weight * mean + seconds) / (weight + 1)]

    # ------------------------------------------------------------------ estimates
    def verify(self, rows: int, width: int) -> float | None:
        """Estimated seconds of verifying ``rows`` x ``width`` tokens; None before any measurement."""
        if (rows, width) in self._verify:
            return self._verify[(rows, width)][1]
        same = {w: m for (r, w), (_, m) in self._verify.items() if r == rows}
        if len(same) >= 2:
            return max(0.0, _line(list(same.items()), width))
        if not self._verify:
            return None
        points = [(r * w, m) for (r, w), (_, m) in self._verify.items()]
        if len({x for x, _ in points}) < 2:  # one shape measured: the same seconds per forward
            return sum(m for _, m in points) / len(points)
        return max(0.0, _line(points, rows * width))

    def draft(self, steps: int) -> float | None:
        """Estimated seconds of drafting ``steps`` steps; None before any measurement."""
        if steps in self._draft:
            return self._draft[steps][1]
        points = [(s, m) for s, (_, m) in self._draft.items()]
        if not points:
            return None
        if len(points) == 1:  # one length measured: its seconds per step
            (s, m), = points
            return m * steps / max(s, 1)
        return max(0.0, _line(points, steps))

    @property
    def measured(self) -> int:
        """How many verification shapes have a measurement."""
        return len(self._verify)


def _line(points: list[tuple[float, float]], x: float) -> float:
    """The least-squares line through ``points`` (x, y) at ``x``."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx > 0 else 0.0
    return my + slope * (x - mx)


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
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    with attention_implementation(target):
        for B in rows:
            _time_rows(target, costs, B, widths, context, repeats, vocab, device)
    return costs


def _time_rows(target, costs: StepCosts, B: int, widths: list[int], context: int, repeats: int, vocab: int,
               device) -> None:
    """:func:`calibrate`'s timings of ``B`` rows."""
    from spec_ext.models import SpecCache, forward

    cache = SpecCache.for_model(target, B, context + max(widths) + 1)
    ids = torch.randint(0, vocab, (B, context), device=device)
    forward(target, ids, cache, torch.arange(context, device=device).expand(B, -1))
    cache.advance([context] * B)
    for width in widths:
        new = torch.randint(0, vocab, (B, width), device=device)
        positions = context + torch.arange(width, device=device).expand(B, -1)
        best = float("inf")
        for _ in range(repeats + 1):
            started = time.perf_counter()
            logits = forward(target, new, cache, positions)
            float(logits[0, -1, 0])  # the host waits for the forward, as a round's sync does
            best = min(best, time.perf_counter() - started)
        costs.record_verify(B, width, best)
