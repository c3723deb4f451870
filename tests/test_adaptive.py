"""Adaptive verification (spec_ext.policies.Adaptive): the trimmed proposal is the brute-force
optimum over every row's prefixes (subtrees) under one budget for the batch, never verifies
past a row's drafts, and decoding stays exact (greedy equal to target.generate with a draft
model and an EAGLE head, ragged with EOS; the sampling law by enumeration)."""
import itertools
import random

import pytest
import torch

import spec_ext
from spec_ext import ops
from spec_ext.drafters import ModelDrafter, Proposal, Sampler
from spec_ext.policies import Adaptive, DynamicTree, StepCosts, Tree, resolve
from spec_ext.policies.step_costs import calibrate
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, llama, perturbed, ragged_greedy_equals_target

PROMPTS = [[5, 17, 33, 8], [40, 2], [7, 7, 9, 1, 3, 11]]


class FixedCosts(StepCosts):
    """Costs given by hand, which rounds do not change: ``verify(rows, width)`` and a draft
    step's seconds."""

    def __init__(self, verify, step=0.0):
        super().__init__()
        self._given, self._step = verify, step
        self._verify = {(1, 1): [1.0, verify(1, 1)]}  # counts as measured

    def verify(self, rows, width):
        return self._given(rows, width)

    def draft(self, steps):
        return self._step * steps

    def record_verify(self, rows, width, seconds):
        pass

    def record_draft(self, steps, seconds):
        pass


class Checked(Adaptive):
    """Adaptive that checks every trim against the proposal it trims and counts them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trims = self.rounds = 0
        self.widths = []  # each chain proposal's width, as drafted

    def select(self, proposal):
        trimmed = super().select(proposal)
        self.rounds += 1
        if not proposal.is_tree:
            self.widths.append(proposal.tokens.shape[1])
        before, after = proposal.num_draft.tolist(), trimmed.num_draft.tolist()
        assert all(0 <= a <= b for a, b in zip(after, before)), (before, after)
        if proposal.is_tree:
            check_subtree(proposal, trimmed)
        else:
            for b, n in enumerate(after):
                assert trimmed.tokens[b, :n].tolist() == proposal.tokens[b, :n].tolist()
                assert (trimmed.tokens[b, n:] == -1).all()
        self.trims += after != before
        return trimmed


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


def fake_clock():
    now = [0.0]
    return now, lambda: now[0]


def survival(policy, confidences):
    out, alive = [], 1.0
    for c in confidences:
        alive *= policy.acceptance(c)
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
    now, clock = fake_clock()
    policy = Adaptive(max_draft=K, costs=FixedCosts(costs), explore=False, clock=clock)
    policy.start(B, greedy=True)
    now[0] = drafted
    proposal = Proposal(tokens, torch.tensor(counts), confidence=confidence)
    trimmed = policy.select(proposal)

    def rate(kept):
        expected = sum(1 + sum(survival(policy, confidence[b, :k].tolist())) for b, k in enumerate(kept))
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
    now, clock = fake_clock()
    policy = Adaptive(max_draft=4, costs=FixedCosts(lambda r, w: 1.0 + 0.1 * (w - 1)), explore=False, clock=clock)
    policy.start(2, greedy=True)
    confidence = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.05, 0.05, 0.05, 0.05]])
    trimmed = policy.select(Proposal(torch.arange(8).view(2, 4), torch.tensor([4, 4]), confidence=confidence))
    assert trimmed.num_draft.tolist() == [4, 4]
    policy.start(1, greedy=True)  # row 1 alone: the roots alone pay best
    trimmed = policy.select(Proposal(torch.arange(4).view(1, 4), torch.tensor([4]), confidence=confidence[1:]))
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
    now, clock = fake_clock()
    policy = Adaptive(tree=Tree((2, 2)), costs=FixedCosts(costs), explore=False, clock=clock)
    policy.start(B, greedy=True)
    proposal = Proposal(tokens, torch.full((B,), T - 1), None, torch.tensor(parents), depth[0], mask,
                        int(depth.max()), confidence=confidence)
    trimmed = policy.select(proposal)

    def node_survival(b, i):
        return 1.0 if i == 0 else node_survival(b, parents[i]) * policy.acceptance(float(confidence[b, i]))

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
    policy.start(1, greedy=True)
    text = Proposal(torch.tensor([[3, 4, 5]]), torch.tensor([3]))
    assert policy.select(text) is text
    policy.start(1, greedy=False)
    sampled = Proposal(torch.tensor([[3, 4, 5]]), torch.tensor([3]), torch.full((1, 3, 8), 1 / 8),
                       confidence=torch.full((1, 3), 0.01))
    assert policy.select(sampled) is sampled


def test_step_costs_read_measured_shapes_and_fit_the_others():
    costs = StepCosts(forget=0.5)
    assert costs.verify(1, 3) is None and costs.draft(2) is None
    costs.record_verify(1, 1, 1.0)
    assert costs.verify(1, 5) == 1.0  # one shape: the same per forward
    costs.record_verify(1, 3, 2.0)
    assert costs.verify(1, 2) == pytest.approx(1.5) and costs.verify(1, 5) == pytest.approx(3.0)
    costs.record_verify(1, 3, 100.0)  # a stall counts as 3x the estimate
    assert costs.verify(1, 3) == pytest.approx((0.5 * 2.0 + 6.0) / 1.5)
    costs.record_verify(4, 2, 5.0)
    assert costs.verify(4, 2) == 5.0 and costs.verify(4, 3) > 0  # another row count: the line over rows x width
    costs.record_draft(2, 0.4)
    assert costs.draft(5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="forget"):
        StepCosts(forget=0.0)


def test_calibrate_times_every_shape_of_the_target():
    target = llama(61, 32, 1, seed=0)
    costs = calibrate(target, rows=(1, 2), widths=(1, 4), context=8, repeats=1)
    assert costs.measured == 4 and all(costs.verify(r, w) > 0 for r in (1, 2) for w in (1, 4))
    with pytest.raises(ValueError, match="widths"):
        calibrate(target, widths=[])


def test_the_policy_by_name_and_bad_arguments():
    assert isinstance(resolve("adaptive"), Adaptive)
    assert Adaptive(tree=DynamicTree(depth=3, top_k=2, nodes=6)).grows_dynamic_tree
    assert Adaptive(tree=Tree((2, 1))).branching == (2, 1)
    for bad in (dict(max_draft=0), dict(tree="tree"), dict(forget=2.0)):
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
    """A draft model whose rows draft unequal chains (budgets 4, 1, 3, ...): the trim must
    keep each row within its own."""

    def propose(self, seqs, roots):
        budget = [(4, 1, 3)[b % 3] for b in range(len(seqs))]
        drafts, q, num_draft, confidence = self.chain(seqs, budget)
        return Proposal(drafts, num_draft, q, confidence=confidence)


@pytest.mark.parametrize("shape", ["chain", "tree", "dynamic", "ragged"])
def test_greedy_equals_the_target_with_a_draft_model(pair, shape):
    target, draft = pair
    tree = {"tree": Tree((2, 2, 1)), "dynamic": DynamicTree(depth=4, top_k=3, nodes=10)}.get(shape)
    policy = Checked(max_draft=5, tree=tree, costs=steep())
    drafter = RaggedBudgets(draft, policy) if shape == "ragged" else draft
    out = ragged_greedy_equals_target(target, drafter, PROMPTS, policy, max_new=30)
    assert 0 < policy.trims < policy.rounds, (policy.trims, policy.rounds)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats


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
    assert 0 < policy.trims < policy.rounds and 0 < out.stats.accepted < out.stats.drafted, (policy.trims, out.stats)


def test_greedy_with_measured_costs_equals_the_target(pair):
    """The default policy, costs measured as the rounds run (wall clock), exploration on."""
    target, draft = pair
    ragged_greedy_equals_target(target, draft, PROMPTS, "adaptive", max_new=30)


@pytest.mark.parametrize("shape,temperature,top_k", [("chain", 1.0, None), ("tree", 0.7, 5)])
def test_sampling_follows_the_targets_law(shape, temperature, top_k):
    """Chains stopped by keep_drafting (sampled drafts are never cut after drafting), trees
    trimmed by confidence (deterministic drafts), against the enumerated law."""
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    draft = perturbed(target, 0.01, seed=11)
    policy = Checked(max_draft=4, tree=Tree((2, 2)) if shape == "tree" else None,
                     costs=FixedCosts(lambda rows, width: 1.0 + 0.05 * (width - 1), step=0.1))
    n = 20_000
    out = spec_ext.generate(target, draft, [PROMPT] * n, max_new_tokens=3, temperature=temperature,
                            top_k=top_k, eos_token_id=[], policy=policy, seed=5)
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(temperature, top_k)))
    if shape == "tree":
        assert policy.trims > 0 and out.stats.drafted > 0
    else:
        # keep_drafting stopped chains at different lengths
        assert policy.trims == 0 and min(policy.widths) < max(policy.widths), policy.widths
    assert out.stats.accepted > 0
