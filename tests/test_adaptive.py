"""Adaptive verification (spec_ext.policies.Adaptive, its AdaptiveController): the trimmed
proposal is the brute-force optimum over every row's prefixes (subtrees) under one budget for
the batch, never verifies past a row's drafts, and decoding stays exact (greedy equal to
target.generate with a draft model and an EAGLE head, ragged with EOS; the sampling law by
enumeration). The controller is driven as the serial engine drives it: ``plan`` (a RoundPlan
whose ``keep_drafting`` and ``select`` the drafter and the engine call), then ``observe`` of a
Report; what calls learn is carried by a shared Memory."""
import bisect
import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch

import spec_ext
from spec_ext import ops
from spec_ext.drafters import BlockDrafter, ModelDrafter, Proposal, Sampler
from spec_ext.policies import Adaptive, Call, Costs, DynamicTree, Memory, Report, RoundState, Tree, calibrate, resolve
from spec_ext.policies.adaptive import AdaptiveController
from spec_ext.policies.estimates import EDGES
from transformers import LogitsProcessor
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, llama, perturbed, ragged_greedy_equals_target

PROMPTS = [[5, 17, 33, 8], [40, 2], [7, 7, 9, 1, 3, 11]]
CENTRES = tuple((lo + hi) / 2 for lo, hi in zip((0.0,) + EDGES, EDGES + (1.0,)))  # the confidence bins' centres


class FixedCosts(Costs):
    """Costs given by hand, which rounds do not change: ``verify(rows, width)`` and a draft
    step's seconds (``step`` None: the drafting's as measured, as Costs measures it).
    ``measured``: one shape counts as measured from the start; ``records``: the shapes the
    rounds verify count as measured (the estimates stay the given ones)."""

    def __init__(self, verify, step=0.0, measured=True, records=False):
        super().__init__()
        self._given, self._step, self._records = verify, step, records
        if measured:
            super().record_verify(1, 1, verify(1, 1))

    def verify(self, rows, width):
        return self._given(rows, width)

    def draft(self, steps, sequential=True, rows=1):
        if self._step is None:
            return super().draft(steps, sequential, rows)
        return self._step * (steps if sequential else 1)

    def record_verify(self, rows, width, seconds):
        if self._records:
            super().record_verify(rows, width, seconds)

    def record_draft(self, steps, seconds, rows=1):
        if self._step is None:
            super().record_draft(steps, seconds, rows)


class Clock:
    """A fake clock for ``Adaptive(clock=...)``: ``now`` seconds, moved by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Log:
    """What the controllers of one :class:`Checked` policy did: the controllers started, the
    rounds trimmed, ``trims`` those that cut some row, ``empty`` those cut to no draft in any
    row (the roots alone verified), ``widths`` each chain proposal's width as drafted; ``dear``:
    the verification is too dear for any draft this round (read by the costs of
    :func:`every_third_round_cut`)."""

    def __init__(self):
        self.controllers = []
        self.trims = self.rounds = self.empty = 0
        self.widths = []
        self.dear = False


@dataclasses.dataclass(frozen=True)
class Checked(Adaptive):
    """Adaptive whose controllers check every trim against the proposal it trims and count
    them in ``log``; ``teach``: (rates, weight) each controller's confidence bins start from
    (:func:`taught`); ``dear_phase``: every third round from this one (0-based), ``log.dear``
    is set before the trim."""
    log: Log = dataclasses.field(default_factory=Log, compare=False, repr=False)
    teach: tuple | None = None
    dear_phase: int | None = None

    def start(self, call):
        return CheckedController(self, call)


class CheckedController(AdaptiveController):
    def __init__(self, policy, call):
        super().__init__(policy, call)
        policy.log.controllers.append(self)
        if policy.teach is not None:
            taught(self.accept, *policy.teach)

    def plan(self, state):
        plan = super().plan(state)
        trim, log, phase = plan.trim, self.policy.log, self.policy.dear_phase

        def checked(proposal):
            if phase is not None:
                log.dear = log.rounds % 3 == phase
            trimmed = trim(proposal)
            log.rounds += 1
            if not proposal.is_tree:
                log.widths.append(proposal.tokens.shape[1])
            before, after = proposal.num_draft.tolist(), trimmed.num_draft.tolist()
            assert all(0 <= a <= b for a, b in zip(after, before)), (before, after)
            if proposal.is_tree:
                check_subtree(proposal, trimmed)
            else:
                for b, n in enumerate(after):
                    assert trimmed.tokens[b, :n].tolist() == proposal.tokens[b, :n].tolist()
                    assert (trimmed.tokens[b, n:] == -1).all()
            log.trims += after != before
            log.empty += max(after) == 0 < max(before)
            return trimmed
        plan.trim = checked
        return plan


def check_subtree(proposal, trimmed):
    """Every row of ``trimmed`` is a subtree of the same row of ``proposal``: its nodes'
    tokens and paths are the proposal's, each node's parent kept, absent nodes -1."""
    B, T = proposal.tokens.shape
    old_parents = proposal.parents.expand(B, T).tolist()
    new_parents = trimmed.parents.expand(B, trimmed.tokens.shape[1]).tolist()
    depth, mask = ops.tree_mask(trimmed.parents.expand(B, -1))
    assert torch.equal(depth, trimmed.depth.expand(B, -1)) and torch.equal(mask, trimmed.mask.expand(B, -1, -1))

    def paths(tokens, parents):
        out, seen = set(), {0: ()}
        for i in range(1, len(tokens)):
            if tokens[i] >= 0:
                assert 0 <= parents[i] < i and parents[i] in seen, (tokens, parents)
                seen[i] = seen[parents[i]] + (tokens[i],)
                out.add(seen[i])
        return out

    for b in range(B):
        kept = paths(trimmed.tokens[b].tolist(), new_parents[b])
        assert kept <= paths(proposal.tokens[b].tolist(), old_parents[b])
        assert len(kept) == int(trimmed.num_draft[b])


def start(policy, rows=1, greedy=True, memory=None, per_forward=1, target=None, draft=None):
    """The controller of a call of ``policy`` over ``rows`` rows."""
    return policy.start(Call(rows, greedy, target, draft, per_forward, memory=memory))


def observe(controller, plan, verified, accepted, seconds=0.0, verify_seconds=0.0, path=None, **report):
    """Report the round of ``plan`` to ``controller``: ``verified`` (the selected proposal) was
    verified and ``accepted[b]`` of row b's drafts were accepted."""
    drafted = verified.num_draft.tolist()
    controller.observe(Report(plan, plan.sources, drafted, list(accepted), [[0] * (a + 1) for a in accepted],
                              verified.width, seconds=seconds, verify_seconds=verify_seconds, path=path, **report))


def carrying(accept, policy, rows=1):
    """A controller of ``policy`` (greedy) that starts from the acceptance ``accept``, carried
    to it by a memory that holds it alone (as a later call of accelerate's starts)."""
    memory = Memory()
    memory.write("acceptance", accept, 0)
    return start(policy, rows, memory=memory)


def chain(confidence, counts=None):
    """A chain proposal of tokens 0, 1, ... with these confidences [B,K] (row b's first counts[b] drafts)."""
    confidence = torch.as_tensor(confidence, dtype=torch.float32)
    B, K = confidence.shape
    return Proposal(torch.arange(K).expand(B, K).clone(), torch.tensor(counts or [K] * B), confidence=confidence)


def taught(accept, rates=CENTRES, weight=1e9):
    """``accept`` (a controller's Acceptance) after ``weight`` observations of each confidence
    bin at both depth classes, each accepted at ``rates[bin]``: its acceptance(c) is that bin's
    rate (until it learns otherwise, at a pace that ``weight`` sets)."""
    accept.bin_reached = [[weight * accept.unit] * len(CENTRES) for _ in range(2)]
    accept.bin_passed = [[weight * accept.unit * r for r in rates] for _ in range(2)]
    accept._cache = None
    return accept


def survival(accept, confidences):
    out, alive = [], 1.0
    for depth, c in enumerate(confidences, 1):
        alive *= accept.acceptance(c, depth)
        out.append(alive)
    return out


def random_costs(rng, rows):
    """Irregular verification costs by width (as the weight-read regime's), growing with the rows."""
    table = {w: 1.0 + rng.random() * 0.5 * (w - 1) ** rng.choice([0.5, 1, 1.5]) for w in range(1, 12)}
    return lambda r, w: table[w] * (1 + 0.3 * (r - 1))


@pytest.mark.parametrize("seed", range(40))
def test_chain_trim_is_the_brute_force_optimum_under_one_budget_for_the_batch(seed):
    rng = random.Random(seed)
    B, K = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
    counts = [rng.randint(0, K) for _ in range(B)]
    counts[0] = K
    confidence = torch.tensor([[rng.choice([rng.random(), 1 - rng.random() ** 4]) if j < n else 0.0
                                for j in range(K)] for n in counts])
    tokens = torch.tensor([[10 + j if j < n else -1 for j in range(K)] for n in counts])
    costs = rng.choice([random_costs(rng, B), lambda r, w: 1.0 + 0.25 * (w - 1) * r])
    drafted = rng.choice([0.0, 0.3, 2.0])
    clock = Clock()
    controller = start(Adaptive(max_draft=K, costs=FixedCosts(costs), explore=False, clock=clock), B)
    plan = controller.plan(RoundState(B))
    clock.now = drafted  # the round's drafting took this long when the selection runs
    proposal = Proposal(tokens, torch.tensor(counts), confidence=confidence)
    trimmed = plan.select(proposal)

    def rate(kept):
        expected = sum(1 + sum(survival(controller.accept, confidence[b, :k].tolist())) for b, k in enumerate(kept))
        return expected / (drafted + costs(B, 1 + max(kept)))

    best = max(rate(kept) for kept in itertools.product(*[range(n + 1) for n in counts]))
    kept = trimmed.num_draft.tolist()
    assert all(k <= n for k, n in zip(kept, counts)), (kept, counts)
    assert rate(kept) == pytest.approx(best, rel=1e-12)
    for b, k in enumerate(kept):
        assert trimmed.tokens[b, :k].tolist() == tokens[b, :k].tolist() and (trimmed.tokens[b, k:] == -1).all()
        assert trimmed.confidence[b, :k].tolist() == confidence[b, :k].tolist()
    assert trimmed.tokens.shape[1] == max(kept)


def test_one_budget_gives_a_weak_row_the_width_a_strong_row_pays_for():
    """Row 0 is worth 4 drafts, row 1 alone would be worth none; the batch pays for width 5
    anyway, so row 1 gets its 4 too (its survivals add tokens at no cost)."""
    clock = Clock()
    policy = Adaptive(max_draft=4, costs=FixedCosts(lambda r, w: 1.0 + 0.1 * (w - 1)), explore=False, clock=clock)
    confidence = [[0.99, 0.99, 0.99, 0.99], [0.05, 0.05, 0.05, 0.05]]
    controller = start(policy, 2)
    taught(controller.accept)  # acceptance = confidence (a calibrated drafter)
    assert controller.plan(RoundState(2)).select(chain(confidence)).num_draft.tolist() == [4, 4]
    controller = start(policy, 1)  # row 1 alone: the roots alone pay best
    taught(controller.accept)
    trimmed = controller.plan(RoundState(1)).select(chain(confidence[1:]))
    assert trimmed.num_draft.tolist() == [0] and trimmed.tokens.shape == (1, 0)


def closed_subsets(parents):
    nodes = range(1, len(parents))
    for size in range(len(parents)):
        for subset in itertools.combinations(nodes, size):
            if all(parents[i] == 0 or parents[i] in subset for i in subset):
                yield subset


@pytest.mark.parametrize("seed", range(15))
def test_tree_trim_is_the_brute_force_optimum_over_subtrees(seed):
    rng = random.Random(seed)
    parents = rng.choice([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4], [-1, 0, 0, 0, 1, 2]])
    B, T = rng.choice([1, 2]), len(parents)
    confidence = torch.tensor([[1.0] + [rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(T - 1)]
                               for _ in range(B)])
    tokens = torch.arange(T).expand(B, T).clone()  # token i at node i: the kept nodes read back
    depth, mask = ops.tree_mask(torch.tensor(parents))
    costs = random_costs(rng, B)
    controller = start(Adaptive(tree=Tree((2, 2)), costs=FixedCosts(costs), explore=False, clock=Clock()), B)
    plan = controller.plan(RoundState(B))
    assert plan.tree == Tree((2, 2)).tree_shape() and not plan.stops
    proposal = Proposal(tokens, torch.full((B,), T - 1), None, torch.tensor(parents), depth[0], mask,
                        int(depth.max()), confidence=confidence)
    trimmed = plan.select(proposal)

    def node_depth(i):
        return 0 if i == 0 else 1 + node_depth(parents[i])

    def node_survival(b, i):
        return 1.0 if i == 0 else node_survival(b, parents[i]) * controller.accept.acceptance(
            float(confidence[b, i]), node_depth(i))

    def rate(sets):
        expected = sum(1 + sum(node_survival(b, i) for i in s) for b, s in enumerate(sets))
        return expected / costs(B, 1 + max(map(len, sets)))

    subsets = list(closed_subsets(parents))
    best = max(rate(sets) for sets in itertools.product(subsets, repeat=B))
    if trimmed is proposal:
        kept = [tuple(range(1, T))] * B
    else:
        check_subtree(proposal, trimmed)
        kept = [tuple(t for t in row if t > 0) for row in trimmed.tokens.tolist()]
        for b, nodes in enumerate(kept):
            assert trimmed.confidence[b, 1:1 + len(nodes)].tolist() == confidence[b, list(nodes)].tolist()
    assert rate(kept) == pytest.approx(best, rel=1e-12)


def test_nothing_is_trimmed_without_confidences_or_for_sampled_chains():
    policy = Adaptive(costs=FixedCosts(lambda r, w: float(w)), explore=False)
    text = Proposal(torch.tensor([[3, 4, 5]]), torch.tensor([3]))
    assert start(policy).plan(RoundState(1)).select(text) is text
    sampled = Proposal(torch.tensor([[3, 4, 5]]), torch.tensor([3]), torch.full((1, 3, 8), 1 / 8),
                       confidence=torch.full((1, 3), 0.01))
    assert start(policy, greedy=False).plan(RoundState(1)).select(sampled) is sampled


def test_step_costs_read_measured_shapes_and_fit_the_others():
    costs = Costs(window=5)
    assert costs.verify(1, 3) is None and costs.draft(2) is None
    costs.record_verify(1, 1, 1.0)
    assert costs.verify(1, 5) == 1.0  # one shape: the same per forward
    costs.record_verify(1, 3, 2.0)
    assert costs.verify(1, 2) == pytest.approx(1.5) and costs.verify(1, 5) == pytest.approx(3.0)
    costs.record_verify(4, 2, 5.0)
    assert costs.verify(4, 2) == 5.0 and costs.verify(4, 3) > 0  # another row count: the line over rows x width
    costs.record_draft(2, 0.4)
    assert costs.draft(5) == pytest.approx(1.0)  # one length: its seconds per step
    assert costs.draft(5, sequential=False) == pytest.approx(0.4)  # a block: its seconds, one forward
    costs.record_draft(4, 0.5)
    assert costs.draft(6, sequential=False) == costs.draft(6) == pytest.approx(0.6)  # two lengths: their line
    # by rows: a batch size's own lengths; one not measured reads a forward's seconds on the
    # line through the measured batch sizes (per step where sequential), never the other rows'
    costs.record_draft(2, 1.6, rows=8)
    assert costs.draft(3, rows=8) == pytest.approx(2.4) and costs.draft(3) == pytest.approx(0.45)
    slope, intercept = np.polyfit([1, 1, 8], [0.4 / 2, 0.5 / 4, 1.6 / 2], 1)  # per step
    assert costs.draft(3, rows=4) == pytest.approx(3 * (intercept + slope * 4))
    block = np.polyfit([1, 1, 8], [0.4, 0.5, 1.6], 1)  # a block: one forward
    assert costs.draft(3, sequential=False, rows=4) == pytest.approx(np.polyval(block, 4))
    # a line falling with the width never prices an unmeasured width below half the cheapest measured
    costs.record_verify(2, 1, 2.0)
    costs.record_verify(2, 3, 1.0)
    assert costs.verify(2, 2) == pytest.approx(1.5) and costs.verify(2, 4) == pytest.approx(0.5)
    assert costs.verify(2, 9) == pytest.approx(0.5)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="window"):
            Costs(window=bad)


def test_a_plain_step_stays_off_the_line_of_the_widths_that_verify_drafts():
    """Width 1 is a plain step (none of a verification's machinery): once two wider widths are
    measured at a batch size, the line that prices the others runs through those alone and
    the plain step reads its own seconds, not pulled toward that line (through all three, an
    unmeasured width 3 read 3.1, and the plain step's cheapness priced every draft low)."""
    costs = Costs()
    costs.record_verify(4, 1, 1.0)
    costs.record_verify(4, 2, 3.0)
    assert costs.verify(4, 3) == pytest.approx(5.0)  # one wide width: the line through the plain step
    costs.record_verify(4, 5, 4.5)
    assert costs.verify(4, 3) == pytest.approx(3.5) and costs.verify(4, 1) == 1.0
    assert costs.verify(4, 2) == pytest.approx(3.0) and costs.verify(4, 9) == pytest.approx(6.5)
    for i in range(Costs.STALE):  # plain steps not taken for long: still their own seconds, not a line's
        costs.record_verify(4, 3 + 2 * (i % 2), 3.5 + (i % 2))
    assert costs.verify(4, 1) == 1.0
    unmeasured = Costs()
    for width, seconds in ((2, 3.0), (5, 4.5)):
        unmeasured.record_verify(4, width, seconds)
    assert unmeasured.verify(4, 1) == pytest.approx(2.5)  # not measured: the line, as any width


def test_a_draft_steps_cost_is_its_rows_low_median_and_merges_both_calls():
    """``Costs.step``: per batch size the low median of its last ``window`` draft steps (None
    before one), other batch sizes apart; ``merged`` keeps both calls' steps (the newer ones of
    each, interleaved), as two calls writing one memory do."""
    costs = Costs(window=3)
    assert costs.step(2) is None
    for seconds in (0.5, 0.1, 0.3, 0.2):
        costs.record_step(2, seconds)
    costs.record_step(8, 0.9)
    assert (costs.step(2), costs.step(8), costs.step(4)) == (0.2, 0.9, None)  # of 0.1 0.3 0.2
    other = Costs(window=3)
    for seconds in (0.7, 0.8):
        other.record_step(2, seconds)
    merged = costs.merged(other)
    assert merged.step(2) == sorted([0.3, 0.2, 0.8])[1] and merged.step(8) == 0.9  # of 0.1 0.7 0.3 0.8 0.2


def test_step_costs_are_the_low_median_of_recent_measurements():
    """A loaded machine's occasional stall does not move a shape's estimate at all (a mean,
    even capped at 3x, moved 1.0 to 1.4 for one 100x stall); a machine that stays slower
    moves it within half the window; of two measurements the faster counts. The estimate is
    checked against the median of the recent window computed here."""
    costs = Costs(window=5)
    costs.record_verify(1, 2, 1.2)
    costs.record_verify(1, 2, 1.0)
    assert costs.verify(1, 2) == 1.0  # two: the faster
    costs.record_verify(1, 2, 1.1)
    costs.record_verify(1, 2, 100.0)  # a stall
    assert costs.verify(1, 2) == 1.1  # sorted 1.0 1.1 1.2 100: the low median
    samples = [1.2, 1.0, 1.1, 100.0]
    rng = random.Random(0)
    for _ in range(40):
        seconds = rng.choice([1.0 + rng.random() * 0.2, 50.0 * rng.random()])
        samples.append(seconds)
        costs.record_verify(1, 2, seconds)
        recent = sorted(samples[-5:])
        assert costs.verify(1, 2) == recent[2]
    for seconds in (3.0, 3.1, 2.9):  # slower for good: three of five recent
        costs.record_verify(1, 2, seconds)
    assert 2.9 <= costs.verify(1, 2) <= 3.1 or costs.verify(1, 2) == sorted(samples[-2:] + [3.0, 3.1, 2.9])[2]
    costs.record_draft(3, 0.3)
    costs.record_draft(3, 9.0)
    assert costs.draft(3) == 0.3


def test_calibrate_times_every_shape_of_the_target():
    target = llama(61, 32, 1, seed=0)
    costs = calibrate(target, rows=(1, 2), widths=(1, 4), context=8, repeats=1)
    assert costs.measured == 4 and all(costs.verify(r, w) > 0 for r in (1, 2) for w in (1, 4))
    with pytest.raises(ValueError, match="widths"):
        calibrate(target, widths=[])


def test_the_timings_take_every_width_once_a_pass_and_never_price_a_narrower_width_above_a_wider(monkeypatch):
    """A slow spell during the first pass slows every width, not the first alone (the fastest of
    the passes is kept), and a width timed slower than a wider one is priced as the wider one."""
    from spec_ext.policies import estimates
    target = llama(61, 32, 1, seed=0)
    order, clock = [], [0.0]
    seconds = {1: 1.0, 2: 3.0, 3: 2.0}  # width 2 slower than width 3: noise

    def fake_forward(model, ids, cache, positions):
        width = ids.shape[1]
        if width != 8:  # the context's forward is not timed
            order.append(width)
            clock[0] += seconds[width] + (100.0 if len(order) <= 3 else 0.0)
        return spec_ext.models.Forward(torch.zeros(ids.shape[0], width, 61))

    monkeypatch.setattr(spec_ext.models, "forward", fake_forward)
    monkeypatch.setattr(estimates.time, "perf_counter", lambda: clock[0])
    costs = Costs()
    estimates.time_rows(target, costs, 1, [3, 1, 2], context=8, repeats=2)
    assert order == [1, 2, 3] * 3
    assert [costs.verify(1, w) for w in (1, 2, 3)] == [1.0, 2.0, 2.0]


def test_the_policy_by_name_and_bad_arguments():
    """By name; a value (frozen settings, equal by them, the costs given not compared), whose
    controllers are apart; the tree's shape, depth and lookahead; bad settings refused by name."""
    assert isinstance(resolve("adaptive"), Adaptive)
    assert Adaptive() == Adaptive(costs=Costs()) and hash(Adaptive(max_draft=6)) == hash(Adaptive(max_draft=6))
    with pytest.raises(dataclasses.FrozenInstanceError):
        Adaptive().max_draft = 3
    policy = Adaptive()
    assert start(policy).accept is not start(policy).accept
    dynamic = Adaptive(tree=DynamicTree(depth=3, top_k=2, nodes=6))
    assert dynamic.tree_shape().dynamic and dynamic.depth_limit == 3
    static = Adaptive(tree=Tree((2, 1)))
    assert static.tree_shape().branching == (2, 1) and static.depth_limit == 2 and static.lookahead == 4
    assert Adaptive(max_draft=7).tree_shape() is None and Adaptive(max_draft=7).lookahead == 7
    for bad in (dict(max_draft=0), dict(tree="tree"), dict(forget=2.0), dict(prior_acceptance=1.0),
                dict(initial=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Adaptive(**bad)


# ---------------------------------------------------------------------------- exact decoding
@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


def steep(slope=0.6):
    """Verification costs that grow fast with the width: trims happen often."""
    return FixedCosts(lambda rows, width: 1e-3 * (1 + slope * rows * (width - 1)), step=1e-4)


class RaggedBudgets(ModelDrafter):
    """A draft model whose rows draft unequal chains (budgets 4, 1, 3, ...) whatever the plan's
    length: the trim must keep each row within its own."""

    def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
        plan = dataclasses.replace(plan, k=[(4, 1, 3)[b % 3] for b in range(len(seqs))])
        return super().propose(seqs, roots, plan, forced, forced_rows)


@pytest.mark.parametrize("shape", ["chain", "tree", "dynamic", "ragged"])
def test_greedy_equals_the_target_with_a_draft_model(pair, shape):
    target, draft = pair
    tree = {"tree": Tree((2, 2, 1)), "dynamic": DynamicTree(depth=4, top_k=3, nodes=10)}.get(shape)
    policy = Checked(max_draft=5, tree=tree, costs=steep())
    drafter = RaggedBudgets(draft) if shape == "ragged" else draft
    out = ragged_greedy_equals_target(target, drafter, PROMPTS, policy, max_new=30)
    log = policy.log
    assert 0 < log.trims < log.rounds, (log.trims, log.rounds)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats
    if shape == "ragged":  # no row past its own budget
        assert max(log.widths) <= 4


@pytest.fixture(scope="module")
def bundled():
    """The bundled target and its EAGLE-3 head, and prompts of three lengths from the demo prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from spec_ext.__main__ import DEMO_PROMPT
    from spec_ext.bundled import bundled_path
    from spec_ext.drafters import load
    target = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-target"), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(bundled_path("stdlib-target"))(DEMO_PROMPT).input_ids
    return target, load(bundled_path("stdlib-head"), target), [ids[:40], ids[:23], ids[:31]]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_equals_the_target_with_a_head(bundled, shape):
    target, head, prompts = bundled
    policy = Checked(max_draft=5, tree=DynamicTree(depth=4, top_k=3, nodes=10) if shape == "tree" else None,
                     costs=steep(0.3))
    out = ragged_greedy_equals_target(target, head, prompts, policy, max_new=24)
    log = policy.log
    assert 0 < log.trims < log.rounds and 0 < out.stats.accepted < out.stats.drafted, (log.trims, out.stats)


def test_greedy_with_measured_costs_equals_the_target(pair):
    """The default policy, costs measured as the rounds run (wall clock), exploration on."""
    target, draft = pair
    ragged_greedy_equals_target(target, draft, PROMPTS, "adaptive", max_new=30)


def law_and_its_power(samples, target, sampler, other, steps):
    """``samples`` [N, steps] follow the target's law under ``sampler``, and the test sees a
    law off by as little as ``other``'s (a sampler at another temperature, under 0.1 away in
    total variation): against that one the same samples fail."""
    joint = exact_joint(target, sampler, steps)
    assert_follows(samples, joint)
    wrong = exact_joint(target, other, steps)
    assert sum(abs(joint[k] - wrong[k]) for k in joint) / 2 < 0.1  # a near law, not a gross one
    with pytest.raises(AssertionError):
        assert_follows(samples, wrong)


@pytest.mark.parametrize("shape,temperature,top_k", [("chain", 1.0, None), ("tree", 0.7, 5)])
def test_sampling_follows_the_targets_law(shape, temperature, top_k):
    """Chains stopped by keep_drafting (sampled drafts are never cut after drafting), trees
    trimmed by confidence (deterministic drafts), against the enumerated law of the first two
    tokens (64 outcomes: small enough for a few thousand rows, which still reject the law at
    another temperature, 0.06 away in total variation)."""
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    draft = perturbed(target, 0.01, seed=11)
    policy = Checked(max_draft=4, tree=Tree((2, 2)) if shape == "tree" else None, teach=(CENTRES, 20),
                     costs=FixedCosts(lambda rows, width: 1.0 + 0.05 * (width - 1), step=0.1))
    n = 5_000
    # a tree's first round emits the first token alone: a third lets the second round draft
    out = spec_ext.generate(target, draft, [PROMPT] * n, max_new_tokens=3 if shape == "tree" else 2,
                            temperature=temperature,
                            top_k=top_k, eos_token_id=[], policy=policy, seed=5)
    law_and_its_power(out.sequences[:, len(PROMPT):len(PROMPT) + 2].numpy(), target, Sampler(temperature, top_k),
                      Sampler(temperature + 0.3 if top_k else 1.5, top_k), steps=2)
    log = policy.log
    if shape == "tree":
        assert log.trims > 0 and out.stats.drafted > 0
    else:
        # keep_drafting stopped chains at different lengths
        assert log.trims == 0 and min(log.widths) < max(log.widths), log.widths
    assert out.stats.accepted > 0


# ---------------------------------------------------------------------------- HF's logits settings
class BanFromLast(LogitsProcessor):
    """A user processor with HF's contract: bans (3 * last id + 1) mod V, from input_ids alone."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, (3 * input_ids[:, -1:] + 1) % scores.shape[-1], float("-inf"))


SETTINGS = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)


def every_third_round_cut(tree=None, phase=2):
    """Checked, its verification cheap but, every third round (from round ``phase``), too dear
    for any draft: those rounds verify the roots alone (no exploration), the others some drafts."""
    log = Log()
    return Checked(max_draft=3, tree=tree, explore=False, log=log, dear_phase=phase, costs=FixedCosts(
        lambda rows, width: 1e-3 * (1 + (100.0 if log.dear else 0.02) * (width - 1)), step=1e-5))


def padded(prompts):
    L = max(map(len, prompts))
    return (torch.tensor([[0] * (L - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts]))


@pytest.fixture(scope="module")
def head_pair():
    from test_heads import echo_head
    target = llama(61, 32, 4, seed=3, sharpen=3.0)
    return target, echo_head(target, "eagle3", draft_vocab=40, noise=0.01)


@pytest.fixture(scope="module")
def block_pair():
    from test_dflash import random_dflash, train
    target = llama(12, 32, 4, seed=3, sharpen=3.0)
    return target, train(target, random_dflash(target, block=4))


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("drafter", ["model", "head", "block"])
def test_hf_settings_with_every_drafter_equal_the_targets_generate(request, drafter, shape):
    """Repetition penalty, no-repeat n-grams and a user LogitsProcessor under adaptive
    verification that cuts some rounds to no draft at all (the roots alone verified: no draft
    position to process), ragged batch: the output is HF's with the same settings."""
    from transformers import LogitsProcessorList
    if drafter == "head":  # the bundled pair (a head accepted under these settings)
        target, draft, prompts = request.getfixturevalue("bundled")
    else:
        target, draft = request.getfixturevalue({"model": "pair", "block": "block_pair"}[drafter])
        prompts = [[p % target.config.vocab_size for p in prompt] for prompt in PROMPTS]
    policy = every_third_round_cut(Tree((2, 2, 1)) if shape == "tree" else None)
    ids, mask = padded(prompts)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0, logits_processor=LogitsProcessorList([BanFromLast()]), **SETTINGS)
    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[],
                            pad_token_id=0, policy=policy, logits_processor=[BanFromLast()], **SETTINGS)
    assert torch.equal(out.sequences, expected)
    log = policy.log
    assert log.empty > 0 and log.empty < log.rounds, (log.empty, log.rounds)
    assert out.stats.accepted > 0


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampling_with_hf_settings_follows_hf_processors(shape):
    """No-repeat bigrams and a repetition penalty at T=0.8 with top-k, rounds cut to no draft
    among them: the first two tokens follow the law HF's processor classes give."""
    from transformers import generation as g
    from test_processing import hf_joint
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    draft = perturbed(target, 0.01, seed=11)
    # the first round verifies the roots alone (a tree's emits the first token alone: then its
    # second round drafts, a third token's worth of budget left)
    policy = every_third_round_cut(Tree((2, 1)) if shape == "tree" else None, phase=0 if shape == "chain" else 1)
    n = 5_000
    out = spec_ext.generate(target, draft, [PROMPT] * n, max_new_tokens=2 if shape == "chain" else 3, temperature=0.8,
                            top_k=6,
                            eos_token_id=[], policy=policy, seed=3, no_repeat_ngram_size=2, repetition_penalty=1.4)

    def law(temperature):
        return hf_joint(target, [g.RepetitionPenaltyLogitsProcessor(1.4), g.NoRepeatNGramLogitsProcessor(2),
                                 g.TemperatureLogitsWarper(temperature), g.TopKLogitsWarper(6)], steps=2)

    samples = out.sequences[:, len(PROMPT):len(PROMPT) + 2].numpy()
    assert_follows(samples, law(0.8))
    near = law(1.1)  # 0.06 away in total variation: the same samples see it
    assert sum(abs(near[k] - v) for k, v in law(0.8).items()) / 2 < 0.1
    with pytest.raises(AssertionError):
        assert_follows(samples, near)
    assert out.stats.accepted > 0
    if shape == "tree":  # deterministic drafts are cut, to none at times
        assert 0 < policy.log.empty < policy.log.rounds, (policy.log.empty, policy.log.rounds)


# ---------------------------------------------------------------------------- calibration from trees
def test_a_tree_rounds_reached_nodes_calibrate_the_confidence_bins():
    """By hand: a tree (root; 1, 2 under it; 3, 4 under 1; 5 under 2), nodes 1 and 3 accepted:
    reached were 1 and 2 (the root's children: the first depth class) and 3 and 4 (node 1's:
    the later one); 5 (under the rejected 2) was never reached. Passed: 1 and 3. Also after
    a trim (node ids renumbered). The rates by depth count the same nodes."""
    parents = [-1, 0, 0, 1, 1, 2]
    conf = [1.0, 0.95, 0.05, 0.85, 0.35, 0.55]  # bins 9, 0, 8, 3, 5
    depth, mask = ops.tree_mask(torch.tensor(parents))
    for trimmed in (False, True):
        # free verification: nothing is cut; a verification that costs far more per node: nodes cut
        cost = (lambda r, w: 1.0 + 0.1 * (w - 1)) if trimmed else (lambda r, w: 1.0)
        controller = start(Adaptive(tree=Tree((2, 2)), costs=FixedCosts(cost), forget=1.0, explore=False,
                                    clock=Clock()))
        accept = taught(controller.accept, weight=10)
        before = [list(r) for r in accept.bin_reached], [list(p) for p in accept.bin_passed]
        by_depth = list(accept.reached), list(accept.passed)
        proposal = Proposal(torch.arange(6)[None], torch.tensor([5]), None, torch.tensor(parents), depth[0], mask,
                            int(depth.max()), confidence=torch.tensor([conf]))
        plan = controller.plan(RoundState(1))
        verified = plan.select(proposal)
        kept = [t for t in verified.tokens[0].tolist() if t > 0]  # token i at node i: the proposal's ids
        assert (kept != [1, 2, 3, 4, 5]) == trimmed, kept
        assert 1 in kept and 3 in kept
        renumber = {0: 0, **{old: new + 1 for new, old in enumerate(kept)}}
        observe(controller, plan, verified, [2], path=torch.tensor([[0, renumber[1], renumber[3]]]))
        reached = [i for i in (1, 2, 3, 4) if i in kept]
        for d, nodes in enumerate(((1, 2), (3, 4))):  # depth 1, depth 2
            for i in range(len(CENTRES)):
                in_bin = [n for n in reached if n in nodes and bisect.bisect_left(EDGES, conf[n]) == i]
                assert accept.bin_reached[d][i] == pytest.approx(before[0][d][i] + len(in_bin)), (d, i)
                assert accept.bin_passed[d][i] == pytest.approx(before[1][d][i] + sum(n in (1, 3) for n in in_bin)), \
                    (d, i)
            at = [n for n in reached if n in nodes]
            assert accept.reached[d + 1] == by_depth[0][d + 1] + len(at)
            assert accept.passed[d + 1] == by_depth[1][d + 1] + sum(n in (1, 3) for n in at)


def test_depth_classes_learn_bursty_acceptance_and_the_plan_follows_it():
    """Chains of 4 drafts, every confidence 0.25, verified whole (a flat verification cost):
    the first draft is accepted in half the rounds, and once it is, every later one. The first
    depth class learns about 1/2, the later one about 1 (one table for all depths would say
    2/3 everywhere, and price 4 drafts at a survival under 0.2 instead of 0.5). plan(), with a
    verification that grows with the width (the acceptance carried to a call priced so),
    then bounds the chains at the most drafts it allows, where the one table (2/3) bounds
    them sooner; where no draft after the first is ever accepted, at the first."""
    priced = Adaptive(max_draft=8, costs=FixedCosts(lambda r, w: 1.0 + 0.05 * (w - 1), step=0.02), forget=1.0,
                      explore=False, clock=Clock())

    def learned(accepted):
        controller = start(Adaptive(max_draft=8, costs=FixedCosts(lambda r, w: 1.0), forget=1.0, explore=False,
                                    clock=Clock()))
        for r in range(60):
            plan = controller.plan(RoundState(1))
            verified = plan.select(chain(torch.full((1, 4), 0.25)))
            assert verified.num_draft.tolist() == [4]
            observe(controller, plan, verified, [accepted(r)])
        return carrying(controller.accept, priced)

    # one table for all depths: 2/3 everywhere, by confidence and by depth
    one_table = start(priced)
    taught(one_table.accept, rates=[2 / 3] * len(CENTRES))
    depths = one_table.accept.depths
    one_table.accept.reached = [0.0] + [1e9] * depths
    one_table.accept.passed = [0.0] + [1e9 * 2 / 3] * depths
    assert [one_table.accept.chance(d) for d in range(1, 9)] == pytest.approx([2 / 3] * 8)
    one_k = one_table.plan(RoundState(1)).k[0]
    bursty = learned(lambda r: 4 if r % 2 else 0)
    assert bursty.accept.acceptance(0.25, 1) == pytest.approx(0.5, abs=0.03)
    assert bursty.accept.acceptance(0.25, 2) > 0.95
    assert bursty.accept.acceptance(0.25, 3) == bursty.accept.acceptance(0.25, 2)
    assert bursty.plan(RoundState(1)).k == [8] and one_k < 8, one_k
    first_only = learned(lambda r: 1)
    assert first_only.accept.acceptance(0.25, 1) > 0.95 and first_only.accept.acceptance(0.25, 2) < 0.05
    assert first_only.plan(RoundState(1)).k[0] == 1 < one_k, one_k


def two_deep(costs):
    """A controller (max_draft 6, R unknown, no exploring, priced by ``costs``) that starts from
    what 40 chains of 4 drafts of confidence 0.5 verified whole taught, the first 2 accepted and
    the third never."""
    controller = start(Adaptive(max_draft=6, costs=FixedCosts(lambda r, w: 1.0), forget=1.0, explore=False,
                                clock=Clock()))
    for _ in range(40):
        plan = controller.plan(RoundState(1))
        observe(controller, plan, plan.select(chain(torch.full((1, 4), 0.5))), [2])
    return carrying(controller.accept, Adaptive(max_draft=6, costs=costs, forget=1.0, explore=False, clock=Clock()))


def best_length(chances, verify, shortest):
    """Brute force: the chain length k >= ``shortest`` (at most len(chances)) with the most
    expected tokens (1 + the sum of survivals) per verify(1, k + 1)."""
    def ratio(k):
        alive, tokens = 1.0, 1.0
        for j in range(k):
            alive *= chances[j]
            tokens += alive
        return tokens / verify(1, k + 1)
    return max(range(shortest, len(chances) + 1), key=ratio)


def pooled(accept, prior_weight=4.0):
    """The later depth class's pooled rate, as Acceptance defines it: every draft past the
    first, with the first draft's rate as its prior (``prior_weight`` observations of it)."""
    w = prior_weight * accept.unit
    return (sum(accept.passed[2:]) + w * accept.chance(1)) / (sum(accept.reached[2:]) + w)


def bin_rate(accept, confidence, depth_class, prior_weight=4.0):
    """A confidence bin's rate in its depth class (0: right after the root; 1: after an
    accepted draft), shrunk toward the class's pooled rate."""
    w, b = prior_weight * accept.unit, bisect.bisect_left(EDGES, confidence)
    prior = accept.chance(1) if depth_class == 0 else pooled(accept, prior_weight)
    return (accept.bin_passed[depth_class][b] + w * prior) / (accept.bin_reached[depth_class][b] + w)


def test_the_plan_prices_each_depth_by_its_own_acceptance():
    """Chains of 4 drafts verified whole, every confidence 0.5: drafts 1 and 2 always accepted,
    draft 3 never (a block drafter's later slots, drawn apart, fall off so). The later class
    pools depths 2-3 at about 1/2 (its prior: the first draft's rate); by depth, draft 2 is
    priced near 1 and draft 3 near 0, so the plan (and the drafting of a sequential drafter)
    stops at 2 where the pooled rate drafts 3 or more for a verification that grows 3% a token
    (brute force of each over k)."""
    def verify(rows, width):
        return 1.0 + 0.03 * (width - 1)
    controller = two_deep(FixedCosts(verify, step=0.0))
    accept = controller.accept
    assert accept.chance(1) > 0.95 and accept.chance(2) > 0.9
    assert accept.chance(3) < 0.1 and accept.chance(4) == pytest.approx(pooled(accept))
    assert pooled(accept) == pytest.approx(0.5, abs=0.05)  # depths 2 and 3 pooled (4 is never reached)
    first = (accept.passed[1] + 4 * 0.8) / (accept.reached[1] + 4)  # draft 1's rate: prior_acceptance's 4
    assert accept.chance(1) == pytest.approx(first)
    assert pooled(accept) == pytest.approx((40 + 4 * first) / (80 + 4))  # (not prior_acceptance's (40 + 3.2) / 84)

    by_depth = [accept.chance(d) for d in range(1, 7)]
    flat = [accept.chance(1)] + [pooled(accept)] * 5
    assert best_length(by_depth, verify, 1) == 2 < best_length(flat, verify, 1)
    plan = controller.plan(RoundState(1))  # R unknown: each round's own ratio, as best_length
    assert plan.k == [2]
    probs = torch.full((1, 8), 0.5)  # one more draft after the second: depth 3, priced near 0
    assert plan.keep_drafting(1, probs, torch.tensor([0]))[0]
    assert not plan.keep_drafting(2, probs, torch.tensor([0]))[0]


def test_the_chain_trim_prices_each_depth_by_its_own_acceptance():
    """As above (drafts 1 and 2 always accepted, draft 3 never, every confidence 0.5), a block
    of 6 drafts is trimmed to its first 2: the trim's chances (the confidence bin's rate x how
    the depth's drafts fared against their bins' rates) price draft 3 near 0 where the later
    class's table alone (pooled 1/2 over depths 2-3) kept 4 or more for a verification that
    grows 3% a token. A draft at depth 1 keeps its bin's rate."""
    def verify(rows, width):
        return 1.0 + 0.03 * (width - 1)
    controller = two_deep(FixedCosts(verify, step=0.0))
    accept = controller.accept
    assert accept.acceptance(0.5, 1) == pytest.approx(bin_rate(accept, 0.5, 0), rel=1e-12)
    assert accept.acceptance(0.5, 2) > 0.9 and accept.acceptance(0.5, 3) < 0.1
    pooled_chances = [bin_rate(accept, 0.5, 0)] + [bin_rate(accept, 0.5, 1)] * 5
    assert best_length(pooled_chances, verify, 0) >= 4
    verified = controller.plan(RoundState(1)).select(chain(torch.full((1, 6), 0.5)))
    chances = [accept.acceptance(0.5, d) for d in range(1, 7)]
    assert verified.num_draft.tolist() == [2] == [best_length(chances, verify, 0)]


def test_a_depths_scale_does_not_count_its_lower_confidences_twice():
    """Bins that tell the truth (taught: each bin accepted at its centre) and chains whose
    confidences fall with depth (0.95, 0.75, 0.45, 0.15), each draft accepted at its bin's rate:
    the depths' own rates fall (0.93 .. 0.15) but what their bins predicted falls as much, so
    each depth's scale stays near 1 and a draft's chance is its bin's rate, not that times the
    depth's rate over the pooled one (0.15 x ~0.25 at depth 4)."""
    controller = start(Adaptive(max_draft=4, costs=FixedCosts(lambda r, w: 1.0), forget=1.0, explore=False,
                                clock=Clock()))
    accept = taught(controller.accept)
    confidences = [0.95, 0.75, 0.45, 0.15]
    rates = [CENTRES[bisect.bisect_left(EDGES, c)] for c in confidences]
    rng = random.Random(0)
    for _ in range(2000):
        plan = controller.plan(RoundState(1))
        verified = plan.select(chain([confidences]))
        assert verified.num_draft.tolist() == [4]
        accepted = 0
        while accepted < 4 and rng.random() < rates[accepted]:
            accepted += 1
        observe(controller, plan, verified, [accepted])
    for depth, (c, rate) in enumerate(zip(confidences, rates), 1):
        assert accept.acceptance(c, depth) == pytest.approx(rate, rel=0.15), depth
    assert accept.chance(4) < 0.3 < accept.chance(2)


def test_plan_drafts_the_best_length_and_one_more_only_when_exploring():
    """A fresh controller (pooled prior 0.8 at every depth, R unknown: the ratio of expected
    tokens to seconds) with a verification of 1 + 0.3 (w - 1) and draft steps of 0.2: the
    brute force over k of (1 + sum_j 0.8^j) / (0.2 k + verify(k + 1)) gives k = 2. plan()
    drafts that many, and with ``explore`` one more in every fourth timed round only (the
    fourth: not a round whose trim verifies one fewer, so the extra draft is verified)."""
    def verify(rows, width):
        return 1.0 + 0.3 * (width - 1)

    def ratio(k):
        return (1 + sum(0.8 ** j for j in range(1, k + 1))) / (0.2 * k + verify(1, k + 1))
    best = max(range(1, 9), key=ratio)
    assert best == 2
    steady = start(Adaptive(max_draft=8, costs=FixedCosts(verify, step=0.2), explore=False))
    assert [steady.plan(RoundState(1)).k for _ in range(8)] == [[best]] * 8
    costs = FixedCosts(verify, step=0.2, records=True)
    for w in (2, 3):  # three widths measured: the trim explores a neighbour every fourth round only
        costs.record_verify(1, w, verify(1, w))
    exploring = start(Adaptive(max_draft=8, costs=costs, clock=Clock()))
    plans, verified = [], []
    for _ in range(8):
        plan = exploring.plan(RoundState(1))
        plans.append(plan.k[0])
        verified.append(int(plan.select(chain(torch.full((1, plan.k[0]), 0.5))).num_draft[0]))
    assert plans == [best, best, best, best + 1] * 2, plans
    # the extra draft is verified (the trim alone keeps a chain of best + 1 whole here), so its depth gets measured
    alone = start(Adaptive(max_draft=8, costs=costs, explore=False)).plan(RoundState(1))
    assert int(alone.select(chain(torch.full((1, best + 1), 0.5))).num_draft[0]) == best + 1
    assert [v for k, v in zip(plans, verified) if k == best + 1] == [best + 1] * 2, (plans, verified)


def test_calls_sharing_a_memory_explore_their_widths_only_until_they_are_measured():
    """With fewer than 3 widths measured, a call's first rounds verify K, K - 1, K - 2 drafts so
    that their costs get measured. The next greedy call through the same memory (as
    ``accelerate`` keeps one) starts from those measured widths and verifies its best width
    from its first round (confident drafts, a nearly flat verification: all K), and explores
    one more or one fewer only every fourth round (the third: one fewer). A sampled call in
    between neither reads the memory nor writes it."""
    clock, memory = Clock(), Memory()
    costs = FixedCosts(lambda r, w: 1.0 + 0.01 * (w - 1), measured=False, records=True)
    policy = Adaptive(max_draft=4, costs=costs, clock=clock)
    teacher = start(policy, memory=memory)  # a call whose acceptance is taught
    taught(teacher.accept)
    teacher.finish()
    proposal = chain(torch.full((1, 4), 0.95))

    def first_rounds(greedy=True):
        controller = start(policy, greedy=greedy, memory=memory)
        widths = []
        for _ in range(3):
            plan = controller.plan(RoundState(1))
            verified = plan.select(proposal)
            widths.append(int(verified.num_draft[0]))
            clock.now += 1.0
            observe(controller, plan, verified, [widths[-1]], seconds=1.0, verify_seconds=0.5)
        controller.finish()
        return widths, controller
    widths, controller = first_rounds()
    assert widths == [4, 3, 2] and controller.costs.measured == 3
    assert memory.read("costs")[0].measured == 3 and costs.measured == 0  # the policy's own costs: untouched
    version = {key: memory.read(key)[1] for key in ("costs", "acceptance")}
    sampled = start(policy, greedy=False, memory=memory)
    assert sampled.costs.measured == 0 and sampled.accept.bin_reached[0][9] == 0  # not what the memory holds
    first_rounds(greedy=False)
    assert {key: memory.read(key)[1] for key in version} == version
    assert first_rounds()[0] == [4, 4, 3]


def test_forgetting_weighs_each_round_forget_times_the_next_over_hundreds_of_rounds():
    """forget=0.5 over 400 rounds (the sums change units on the way): the acceptance of a first
    draft equals the rates recomputed from every reached draft weighted forget ** (rounds
    since), with the priors as Acceptance gives them."""
    rng = random.Random(0)
    clock = Clock()
    forget, w, prior = 0.5, 4.0, 0.8
    controller = start(Adaptive(max_draft=3, costs=FixedCosts(lambda r, width: 1.0), forget=forget, prior_weight=w,
                                prior_acceptance=prior, explore=False, clock=clock))
    history = []  # per round: (bin, passed) of the reached first drafts
    for _ in range(400):
        confidence = [rng.random() for _ in range(3)]
        plan = controller.plan(RoundState(1))
        verified = plan.select(chain([confidence]))
        n = int(verified.num_draft[0])
        a = sum(1 for _ in itertools.takewhile(lambda c: rng.random() < c, confidence[:n]))
        clock.now += 1.0
        observe(controller, plan, verified, [a], seconds=1.0)
        history.append([(bisect.bisect_left(EDGES, confidence[0]), a > 0)] if n else [])
    reached, passed = [0.0] * len(CENTRES), [0.0] * len(CENTRES)
    for age, events in enumerate(reversed(history)):
        for i, ok in events:
            reached[i] += forget ** age
            passed[i] += forget ** age * ok
    first = (sum(passed) + w * prior) / (sum(reached) + w)
    accept = controller.accept
    assert accept.chance(1) == pytest.approx(first, rel=1e-9)
    for i, centre in enumerate(CENTRES):
        assert accept.acceptance(centre, 1) == pytest.approx(min(1.0, (passed[i] + w * first) / (reached[i] + w)),
                                                             rel=1e-9), i
    assert accept.unit < 1e100


def test_a_block_drafter_drafts_the_length_worth_its_verification(block_pair):
    """A block drafter's plan is the best length by the costs, as a chain's is, not its whole
    block: with a verification of 1 + (w - 1) and a block forward of 0.1 whatever its length,
    the brute force over k of (1 + sum_j 0.8^j) / (0.1 + verify(k + 1)) gives k = 1 of the
    block's 3 (and the whole block for a flat verification). In a call, each round's block
    computes the slots of that round's plan and no more, and the output is the target's."""
    def ratio(k, slope):
        return (1 + sum(0.8 ** j for j in range(1, k + 1))) / (0.1 + 1.0 + slope * k)
    target, draft = block_pair
    for slope, expected in ((1.0, 1), (0.0, 3)):
        assert max(range(1, 4), key=lambda k: ratio(k, slope)) == expected
        policy = Adaptive(max_draft=3, costs=FixedCosts(lambda r, w, s=slope: 1.0 + s * (w - 1), step=0.1),
                          explore=False)
        assert start(policy, per_forward=3).plan(RoundState(1)).k == [expected]
        slots = []

        class Recording(BlockDrafter):
            def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
                self.planned = max(plan.k)
                return super().propose(seqs, roots, plan, forced, forced_rows)

            def block(self, roots, n=None):
                logits, hidden = super().block(roots, n)
                slots.append((logits.shape[1], self.planned))
                return logits, hidden
        ids, mask = padded([[p % target.config.vocab_size for p in prompt] for prompt in PROMPTS])
        out = spec_ext.generate(target, Recording(draft), ids, attention_mask=mask, max_new_tokens=12,
                                eos_token_id=[], pad_token_id=0, policy=policy)
        assert slots[0] == (expected, expected) and all(n == planned for n, planned in slots), slots
        assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, max_new_tokens=12,
                                                          do_sample=False, eos_token_id=None, pad_token_id=0))


def test_a_sampled_call_prices_its_rounds_by_rounds_the_engine_timed_once_per_process():
    """A sampled call's rounds are priced by the engine's own rounds, run once per process
    (target, draft, rows, sampling) on random ids: every chain length of the schedule and a
    plain run timed at the call's batch size, the draft's steps, its catch-up over skipped
    steps. The timing draws nothing from the global random state, so two sampled calls from
    the same torch.manual_seed, the first of them the one that timed, give the same output,
    each priced by that one timing; another batch size is timed anew."""
    from spec_ext.policies.estimates import timing_schedule
    target = llama(61, 32, 2, seed=12, sharpen=3.0)
    draft = perturbed(target, 0.003, seed=2)
    outputs, timed = [], []
    for _ in range(2):
        torch.manual_seed(0)
        policy = Checked()
        outputs.append(spec_ext.generate(target, draft, [PROMPT, PROMPT[:5]], max_new_tokens=16, temperature=1.0,
                                         eos_token_id=[], policy=policy).sequences)
        controller, = policy.log.controllers
        timed.append(controller.pricing.modeled)
        assert controller.pricing.modeled_rows == 2
    assert torch.equal(outputs[0], outputs[1]) and timed[0] is timed[1]
    costs, lengths = timed[0], sorted(set(timing_schedule(Checked().depth_limit)) - {0})
    assert costs.widths(2) == [1] + [k + 1 for k in lengths]
    assert sorted(rows_steps[1] for rows_steps in costs._draft) == lengths
    assert all(costs.verify(2, w) > 0 for w in range(1, 10)) and costs.catch_up(8) > 0
    assert controller.verify_cost(2, 4) == costs.verify(2, 4) != costs.verify(2, 1)  # (the calls' pricing)
    torch.manual_seed(0)
    policy = Checked()
    spec_ext.generate(target, draft, [PROMPT], max_new_tokens=4, temperature=1.0, eos_token_id=[], policy=policy)
    assert policy.log.controllers[0].pricing.modeled not in timed


@pytest.mark.parametrize("kind", ["draft model", "eagle3 head", "block drafter"])
def test_a_sampled_auto_call_times_its_own_drafters_rounds(kind, monkeypatch):
    """Sampled Auto's rounds are priced by the engine's rounds with a drafter of the call's
    kind, timed once per process: a verification of every chain length of the schedule (a
    block drafter's: up to its slots) and of a plain run, the draft by steps, and the
    catch-ups where the drafter catches up (a draft model and an EAGLE head over the prompt and
    the plain runs, the head's prompt read at its first drafting round; none for a block
    drafter, which reads what was committed at every commit). Two seeded calls agree."""
    from spec_ext.policies import Auto, estimates
    from test_dflash import random_dflash
    from test_heads import echo_head
    target = llama(61, 32, 2, seed=14, sharpen=3.0)
    draft = {"draft model": lambda: perturbed(target, 0.003, seed=2),
             "eagle3 head": lambda: echo_head(target, "eagle3", noise=0.01),
             "block drafter": lambda: random_dflash(target, block=4, seed=4, scale=0.5)}[kind]()
    timed, time_rounds = [], estimates.round_costs
    monkeypatch.setattr(estimates, "round_costs", lambda *args: timed.append(time_rounds(*args)) or timed[-1])
    outputs = [spec_ext.generate(target, draft, [PROMPT, PROMPT[:5]], max_new_tokens=12, temperature=1.0,
                                 eos_token_id=[], policy=Auto(), seed=3).sequences for _ in range(2)]
    assert torch.equal(outputs[0], outputs[1]) and len(timed) == 2 and timed[0] is timed[1]
    costs = timed[0]
    lengths = sorted(set(estimates.timing_schedule(3 if kind == "block drafter" else Auto().max_draft)) - {0})
    assert costs.widths(2) == [1] + [k + 1 for k in lengths]
    assert sorted(steps for rows, steps in costs._draft) == lengths
    caught_up = {tokens for tokens, _ in costs._catch_up}
    assert len(caught_up) >= 3 if kind != "block drafter" else not caught_up, costs._catch_up


def test_a_tensor_parallel_target_is_not_timed_for_sampled_rounds():
    """A tensor-parallel target's followers replay every forward its leading rank runs: a
    timing run there would desynchronise them. Its sampled rounds are priced flat (Adaptive
    and, beside a block drafter, Auto); a target on one device is timed by the engine."""
    from spec_ext.policies import Auto

    class Timing:
        key = ()

        def __call__(self, controller, rows):
            raise AssertionError("timed")
    target = llama(61, 32, 2, seed=13)
    draft = perturbed(target, 0.003, seed=2)
    target._tp_size = 2
    for policy in (Adaptive(), Auto()):
        controller = policy.start(Call(1, False, target, draft, 4, time_rounds=Timing()))
        assert controller.pricing.modeled is None
    assert Adaptive().start(Call(1, False, target, draft, time_rounds=Timing())).verify_cost(1, 3) == 1.0
    del target._tp_size
    with pytest.raises(AssertionError, match="timed"):
        Auto().start(Call(1, False, target, draft, 4, time_rounds=Timing()))


@pytest.mark.parametrize("slope, expected", [(1.0, 1), (0.0, 3)])
def test_a_sampled_block_is_as_long_as_its_priced_verification_pays(block_pair, slope, expected):
    """Sampling, with measured verification costs (1 + slope (w - 1); no draft measured: a block
    forward is priced at the drafter's share of the target's parameters): the block drafted is
    the length that pays, 1 of 3 on a steep verification and the whole block on a flat one
    (a flat cost everywhere drafted the whole block on a CPU, where a verification of 16
    tokens costs 2.5 steps), and each round's block computes that many slots."""
    target, draft = block_pair
    costs = Costs()
    for w in range(1, 5):
        costs.record_verify(1, w, 1.0 + slope * (w - 1))
    policy = Adaptive(max_draft=3, costs=costs)
    slots = []

    class Recording(BlockDrafter):
        def block(self, roots, n=None):
            logits, hidden = super().block(roots, n)
            slots.append(logits.shape[1])
            return logits, hidden
    prompt = [p % target.config.vocab_size for p in PROMPTS[0]]
    spec_ext.generate(target, Recording(draft), [prompt], max_new_tokens=12, eos_token_id=[],
                      temperature=1.0, seed=0, policy=policy)
    assert slots[0] == expected, slots


def test_a_stale_draft_step_cost_does_not_stop_every_chain_for_good():
    """The draft step's cost is stale: one stalled round drafted 2 steps in 2 s; a forward
    really takes a millisecond. Confident drafts, a verification of 10 ms: chains stop at
    their first draft (the plan's one more, every fourth round, is not drafted either: its
    step is priced at the stale cost) until the exploring round (the eighth) drafts a second
    step, whose measured time then lets the next chains go on."""
    clock = Clock()
    costs = FixedCosts(lambda r, w: 10e-3, step=None)
    costs.record_draft(2, 2.0)
    controller = start(Adaptive(max_draft=6, costs=costs, clock=clock))
    probs, token = torch.tensor([[0.02, 0.98]]), torch.tensor([1])
    went = []
    for r in range(10):
        started = clock.now
        plan = controller.plan(RoundState(1))
        clock.now += 1e-3  # the forward that drafts the first draft (the catch-up)
        go = plan.keep_drafting(1, probs, token)
        went.append(bool(go[0]))
        if go[0]:
            clock.now += 1e-3
            plan.keep_drafting(2, probs, token)
        verified = plan.select(chain([[0.98, 0.98][:1 + went[-1]]]))
        clock.now += 10e-3
        n = int(verified.num_draft[0])
        observe(controller, plan, verified, [n], seconds=clock.now - started, verify_seconds=10e-3,
                draft_forwards=1 + went[-1], draft_steps=1 + went[-1], warm=r > 0)
    assert went[:7] == [False] * 7 and went[7] and all(went[8:]), went
    assert controller.costs.draft(2) == pytest.approx(2e-3)  # the stale 2 s out (of 2 measurements, the faster)


@pytest.mark.parametrize("drafter", ["model", "head"])
def test_tree_rounds_update_the_calibration_and_the_step_costs(request, drafter):
    """Greedy tree rounds (wall clock): every accepted draft is counted as passed once in the
    confidence bins and by depth (forget=1: their added passes sum to the accepted drafts),
    each bin saw at least as many reached as passed, and the verification's and the
    drafting's costs were measured; the output is the target's. What the call learned goes
    into the call's memory at its end."""
    target, draft = request.getfixturevalue({"model": "pair", "head": "head_pair"}[drafter])
    V = target.config.vocab_size
    prompts = [[p % V for p in prompt] for prompt in PROMPTS]
    policy = Checked(tree=DynamicTree(depth=3, top_k=2, nodes=6), costs=Costs(), forget=1.0)
    out = ragged_greedy_equals_target(target, draft, prompts, policy, max_new=20)
    controller, = policy.log.controllers
    accept = controller.accept
    passed, reached = sum(accept.bin_passed, []), sum(accept.bin_reached, [])  # a fresh controller's: all new
    assert sum(passed) == pytest.approx(out.stats.accepted) and out.stats.accepted > 0
    assert sum(accept.passed) == pytest.approx(out.stats.accepted) and sum(accept.reached) == sum(reached)
    assert all(r >= p - 1e-9 for r, p in zip(reached, passed)) and sum(reached) > sum(passed)
    costs = controller.costs
    assert costs.measured > 0 and costs.draft(1) is not None, (costs.measured, costs.draft(1))
    assert policy.costs.measured == 0  # the policy's own costs: a value, copied per call
    memory = Memory()
    ids, mask = padded(prompts)
    spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0,
                      policy=policy, memory=memory)
    assert memory.read("costs")[0].measured > 0 and sum(memory.read("acceptance")[0].reached) > 0


def test_timed_rounds_take_their_seconds_from_the_report():
    """A greedy round's verification costs its report's ``verify_seconds`` (at the width and
    rows it verified); its drafting, the rest of the round's ``seconds``, counts for the draft
    steps it computed only where the report says those forwards were warm (not a catch-up over
    the prompt); the long-run rate counts every round but the first (committed tokens over the
    rounds' seconds)."""
    controller = start(Adaptive(max_draft=4, costs=Costs(), explore=False, clock=Clock()))
    for n, (seconds, verify, warm) in enumerate(((9.0, 1.0, False), (0.5, 0.3, True), (0.7, 0.4, True))):
        plan = controller.plan(RoundState(1))
        assert plan.k == [4] or n == 2  # ``initial`` while the verification's or a draft's cost is unknown
        verified = plan.select(chain([[0.9, 0.9]]))
        assert verified.width == 3
        observe(controller, plan, verified, [1], seconds=seconds, verify_seconds=verify, warm=warm,
                draft_forwards=2, draft_steps=2)
    costs = controller.costs
    assert costs.widths(1) == [3] and costs.verify(1, 3) == pytest.approx(0.4)  # the median of 1.0, 0.3, 0.4
    assert costs.draft(2) == pytest.approx(0.2)  # the warm rounds' drafting: 0.2 and 0.3, the first's 8.0 left out
    keep = Adaptive.RATE_FORGET
    assert controller.rate == pytest.approx((keep * 2 + 2) / (keep * 0.5 + 0.7))
