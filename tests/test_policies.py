"""The decisions of the rule-based policies on constructed rounds: Auto, Heuristic,
Confidence, SVIP, driven through their controllers (plan, observe) with reports made here.
A wrong choice is still exact, so only these tests catch it (exactness of every policy is in
test_decoding, which runs each registered one)."""
import dataclasses
import random

import pytest
import torch

import spec_ext
from spec_ext.policies import (SVIP, Auto, Call, Confidence, Heuristic, Memory, Report, RoundPlan, RoundState, Source,
                               TreeShape, resolve)
from spec_ext.policies.auto import AutoController
from spec_ext.policies.estimates import Costs
from helpers import llama, perturbed, plan_of


class Text:
    """A TextLookup whose row b offers a chain of ``offers[b]`` drafts (tokens 100, 101, ...)."""

    def __init__(self, offers):
        self.offers = list(offers)

    def chain(self, row, most):
        return list(range(100, 100 + min(self.offers[row], most)))

    def tree(self, row, depth, nodes):
        return None

    def cache_match(self, row):
        return 0

    def cache_tree(self, row, depth, nodes):
        return None


def start(policy=None, rows=1, greedy=True, memory=None, per_forward=1, wait=0, target=None, draft=None):
    return (policy or Auto()).start(Call(rows, greedy, target, draft, per_forward, wait, memory))


def play(controller, verify, accepted, offers=None, rounds=1, per_forward_seconds=0.0, per_forward=1, rng=None,
         warm=None):
    """Rounds of ``controller``: row b's text offers ``offers[b]`` drafts (None: no text); a
    round costs verify(width) + per_forward_seconds per draft forward; ``accepted(rng, source)``
    draws a row's accepted run. Returns every round's plan (a plain run's once per step, as
    the engine runs it: one report of its steps)."""
    rng = rng or random.Random(0)
    plans = []
    while len(plans) < rounds:
        n, rows = len(plans), controller.rows
        text = None if offers is None else Text(offers)
        plan = controller.plan(RoundState(rows, text))
        drafted = [len(t.tokens) if t is not None else k for t, k in zip(plan.text, plan.k)]
        width = 1 + max(drafted)
        steps = max(plan.k)
        forwards = -(-steps // per_forward) if plan.model_runs else 0
        draft_seconds = per_forward_seconds * forwards
        runs = [min(d, accepted(rng, s)) for d, s in zip(drafted, plan.sources)]
        plain = plan.steps if plan.plain else 1
        controller.observe(Report(plan, plan.sources, drafted, runs, [[0] * (a + plain) for a in runs], width,
                                  seconds=verify(width) + draft_seconds, draft_seconds=draft_seconds,
                                  draft_forwards=forwards, draft_steps=steps,
                                  warm=(n > 0) if warm is None else warm(n), steps=plain))
        plans += [plan] * plain
    return plans[:rounds]


def geometric(alpha):
    """Runs of drafts each accepted with chance alpha until the first miss."""
    def run(rng, source=None):
        n = 0
        while n < 64 and rng.random() < alpha:
            n += 1
        return n
    return run


def ks(plans):
    return [max(p.k) for p in plans]


def plain_picks(controller, plans, last=80):
    """The k of the late rounds that do not explore."""
    every = controller.policy.explore_every
    start_ = len(plans) - last
    return [max(p.k) for n, p in enumerate(plans[start_:], start=start_ + 1) if n % every]


def test_a_policy_is_a_value():
    """Policies are frozen dataclasses: equal by their settings, hashable, printed with their
    arguments, immutable; the controllers a policy starts are apart (nothing of one call
    reaches another)."""
    assert Auto() == Auto() and hash(Auto(max_draft=6)) == hash(Auto(max_draft=6)) and Auto() != Auto(initial=3)
    assert repr(Auto(max_draft=6)).startswith("Auto(max_draft=6, initial=4")
    assert resolve("tree") == spec_ext.policies.Tree() and {Auto(), Auto()} == {Auto()}
    with pytest.raises(dataclasses.FrozenInstanceError):
        Auto().max_draft = 3
    policy = Auto()
    a, b = start(policy), start(policy)
    play(a, lambda w: 10.0, geometric(0.9), rounds=20)
    assert a.rounds == 20 and b.rounds == 0 and a.accept[Source.MODEL] is not b.accept[Source.MODEL]


def test_auto_prices_each_width_as_measured_and_maximises_tokens_per_second():
    """A verification's cost by width is irregular where the step is weight reads: here 5
    tokens cost what one does and 6 cost 2.5x. A line a + b*k through those costs would
    draft past the step; the estimates per width stop at 4 drafts."""
    controller = start(Auto(max_draft=12, forget_runs=1.0))
    verify = lambda w: 10.0 if w <= 5 else 25.0  # noqa: E731
    plans = play(controller, verify, geometric(0.9), rounds=400)
    chosen = ks(plans)
    assert chosen[0] == 4, "the initial k until a round is timed"
    assert chosen[1] == 1, "then the narrowest chain, so that two widths give the cost's slope"
    assert controller.survival()[:4] == pytest.approx([0.9, 0.81, 0.729, 0.656], abs=0.05)
    for w in (5, 6):  # each read mostly as measured, shrunk a little toward the line
        assert controller.costs.verify(1, w) == pytest.approx(verify(w), rel=0.25)
    picks = plain_picks(controller, plans, last=300)
    # a width left unmeasured for STALE rounds reads the fresh widths' line: below the step it reads cheap,
    # so now and then a narrow chain is measured again
    assert max(picks) == 4 and picks.count(4) >= 0.95 * len(picks), picks
    every = controller.policy.explore_every
    explored = {n: k for n, k in enumerate(chosen, start=1) if n > 100 and n % every == 0}
    assert {3, 5} <= set(explored.values()), "every explore_every-th round tries one more, then one less"


def test_auto_reads_a_chains_costs_from_the_widths_a_chain_verifies():
    """A round that verified a tree wider than any chain (a suffix cache tree of 32 tokens, 90
    s) is kept at its width, but does not count as a chain's: the next rounds time the initial
    chain, then the narrowest, as a call's first rounds do, and the chains' widths are soon
    read as measured."""
    controller = start(Auto(max_draft=12))
    verify = lambda w: 10.0 + 0.5 * (w - 1)  # noqa: E731
    plan = controller.plan(RoundState(1))
    controller.observe(Report(plan, [Source.CACHE], [31], [0], [[0]], 32, seconds=90.0))
    chosen = ks(play(controller, verify, geometric(1.0), rounds=40))
    assert chosen[:2] == [4, 1], chosen
    assert controller.costs.verify(1, 32) == pytest.approx(90.0, rel=0.3)
    for w in set(k + 1 for k in chosen[20:]):
        assert controller.costs.verify(1, w) == pytest.approx(verify(w), rel=0.25), w


def test_auto_values_bursty_runs_as_they_are():
    """Runs of 0 or >= 12 (a draft either gets a passage or not): the mean acceptance of a
    geometric law would say stop early, the runs say draft to the end."""
    controller = start(Auto(max_draft=12, forget_runs=1.0))
    plans = play(controller, lambda w: 10.0 + 1.5 * (w - 1), lambda rng, s: 0 if rng.random() < 0.4 else 12,
                 rounds=600)
    assert min(plain_picks(controller, plans)) >= 11
    assert controller.survival()[-1] == pytest.approx(0.6, abs=0.1)


def observe_runs(controller, drafted, accepted):
    plan = controller.plan(RoundState(1))
    controller.observe(Report(plan, [Source.MODEL], [drafted], [accepted], [[0] * (accepted + 1)], drafted + 1))


def test_auto_prices_a_depth_rarely_reached_like_the_drafts_after_an_accepted_one():
    """Rounds of 2 drafts, the second accepted 90% of the time after the first: drafts 3-12,
    never reached, are priced at that pooled rate, not at the flat prior (0.5); two failures
    at depth 3 price that depth down, not the depths past it."""
    controller = start(Auto(forget_runs=1.0), greedy=False)
    rng = random.Random(0)
    for _ in range(200):
        first = rng.random() < 0.8
        observe_runs(controller, 2, 0 if not first else 2 if rng.random() < 0.9 else 1)
    s = controller.survival()
    assert s[0] == pytest.approx(0.8, abs=0.06) and s[1] / s[0] == pytest.approx(0.9, abs=0.05)
    for j in range(2, 12):
        assert s[j] / s[j - 1] == pytest.approx(s[1] / s[0], abs=0.01), j
    observe_runs(controller, 3, 2)
    observe_runs(controller, 3, 2)
    s = controller.survival()
    assert s[2] / s[1] < 0.4 and s[3] / s[2] == pytest.approx(s[1] / s[0], abs=0.02)


def test_auto_grows_a_chain_a_draft_a_round_past_the_depths_it_measured():
    """Drafts 1-2 always accepted and 3 never (a block drafter's later slots): each round's k
    is at most one past the deepest draft reached before it (one more in an exploring round),
    and it settles at 2; where drafts are accepted 97% of the time it still grows to the
    longest, a draft a round."""
    for accepted, longest in ((lambda rng, s: 2, 2), (geometric(0.97), 12)):
        controller = start(Auto(max_draft=12, forget_runs=1.0))
        rng, plans = random.Random(0), []
        for r in range(150):
            reached = controller.accept[Source.MODEL].reached
            deepest = max((j for j in range(1, len(reached)) if reached[j] > 0), default=0)
            plan, = play(controller, lambda w: 10.0 + 0.2 * (w - 1), accepted, rounds=1, rng=rng)
            k = max(plan.k)
            if r >= 2:
                every = controller.policy.explore_every
                explores = controller.rounds % (2 * every) == every
                assert k <= deepest + 1 + explores, (r, k, deepest)
            plans.append(plan)
        assert max(plain_picks(controller, plans)) == longest, ks(plans)


def test_auto_kept_across_calls_starts_each_from_the_last_calls_estimates():
    """A greedy call of 60 rounds (5 tokens cost what 1 does, 6 cost 2.5x; drafts accepted 90%)
    measures its way from the initial k (2) and the narrowest chain to k = 4. The next greedy
    call through the same memory starts at 4 with no measuring round (a sampled call in
    between reads and writes nothing); a call of another batch size carries the acceptance but
    not the costs (the initial k, then the narrowest); a new memory starts cold."""
    memory, policy = Memory(), Auto(max_draft=12, initial=2, forget_runs=1.0)
    verify = lambda w: 10.0 if w <= 5 else 25.0  # noqa: E731

    def call(rows, rounds=60, accepted=geometric(0.9), into=memory, greedy=True):
        controller = start(policy, rows, greedy, into)
        plans = play(controller, verify, accepted, rounds=rounds)
        controller.finish()
        return ks(plans), controller
    first, _ = call(1)
    assert first[:2] == [2, 1] and first[-1] == 4, first
    assert call(1, 3)[0] == [4, 4, 4]
    for _ in range(2):
        chosen, controller = call(1, 3, accepted=lambda rng, s: 0, greedy=False)
        assert controller.survival()[0] < 0.5, "a sampled call starts from the prior alone"
    assert call(1, 3)[0] == [4, 4, 4]
    assert call(2, 3, accepted=lambda rng, s: 0)[0][:2] == [2, 1]
    _, controller = call(1, 1)
    assert controller.survival()[0] > 0.75, "the acceptance carried (3 rejections after ~100 accepted)"
    cold, controller = call(1, 2, accepted=lambda rng, s: 0, into=Memory())
    assert cold == [2, 1] and controller.survival()[0] < 0.3


def test_auto_kept_across_calls_carries_the_texts_acceptance():
    """A greedy call whose row's text offers 8 drafts that are never accepted (the model's
    drafts 60%) learns to leave the text alone. The next greedy call through the same memory
    starts from that: it drafts the model, never the text; a greedy call with a new memory
    tries the text first, and a sampled call reads none of it (the prior)."""
    memory, policy = Memory(), Auto(forget_runs=1.0)
    verify = lambda w: 10.0 + 0.1 * (w - 1)  # noqa: E731
    runs = by_source(lambda rng: 0, geometric(0.6))

    def call(into, rounds, greedy=True):
        controller = start(policy, 1, greedy, into)
        plans = play(controller, verify, runs, offers=[8], rounds=rounds, per_forward_seconds=0.5)
        controller.finish()
        return plans, controller
    plans, controller = call(memory, 80)
    assert plans[0].sources == [Source.TEXT] and controller.survival(Source.TEXT)[0] < 0.1
    assert start(policy, 1, True, memory).survival(Source.TEXT)[0] < 0.1, "the next greedy call reads it"
    again, controller = call(memory, 8)
    assert all(p.sources == [Source.MODEL] for p in again), [p.sources for p in again]
    assert controller.survival(Source.TEXT)[0] < 0.1
    cold, _ = call(Memory(), 1)
    assert cold[0].sources == [Source.TEXT]
    assert start(policy, 1, False, memory).survival(Source.TEXT)[0] == pytest.approx(policy.prior_acceptance)


def test_the_memory_merges_calls_that_ran_at_once():
    """Two calls that read the memory at once both write back: the second's write merges with
    the first's (each holds what they both read), so both contribute; a call alone replaces it."""
    memory, policy = Memory(), Auto(forget_runs=1.0)
    a, b = start(policy, memory=memory), start(policy, memory=memory)
    play(a, lambda w: 10.0, lambda rng, s: 3, rounds=40)
    play(b, lambda w: 30.0, lambda rng, s: 0, rounds=40)
    a.finish()
    b.finish()
    merged = start(policy, memory=memory)
    first = merged.survival()[0]
    assert 0.2 < first < 0.8, "both calls' runs: always accepted and never"
    assert 10.0 < merged.costs.verify(1, 4) < 30.0
    alone = Memory()
    c = start(policy, memory=alone)
    play(c, lambda w: 30.0, lambda rng, s: 0, rounds=40)
    c.finish()
    assert start(policy, memory=alone).survival()[0] < 0.1


def test_auto_kept_by_accelerate_stays_exact_and_a_seed_reproduces_a_sampled_call():
    """One accelerate object (its memory kept across calls) through greedy calls of batch 1 and
    a ragged 3 and seeded sampled calls in between: every greedy output equals the target's,
    and a seeded sampled call gives the same tokens whatever the calls before it measured."""
    from helpers import hf_greedy
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.02, seed=1)
    fast = spec_ext.accelerate(target, draft)
    prompts = [[5, 17, 33, 8, 40, 2], [7, 8, 9], [40, 2, 11, 40, 2, 6, 1]]
    ids = torch.tensor([prompts[0]])
    sampled = fast.generate(ids, do_sample=True, seed=3, max_new_tokens=24, eos_token_id=[], pad_token_id=0)
    for batch in ([prompts[0]], prompts, [prompts[2]]):
        width = max(map(len, batch))
        padded = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = fast.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=[],
                            pad_token_id=0)
        for b, p in enumerate(batch):
            assert out[b, -24:].tolist() == hf_greedy(target, p, 24, eos=[]), (batch, b)
        again = fast.generate(ids, do_sample=True, seed=3, max_new_tokens=24, eos_token_id=[], pad_token_id=0)
        assert torch.equal(again, sampled)
    assert {"costs", "model", "text"} <= set(fast.memory.keys())


def test_auto_drafts_less_when_drafts_cost_more_and_follows_rows_finishing():
    picks = {}
    for per_draft in (0.2, 3.0):
        controller = start(Auto(forget_runs=1.0))
        plans = play(controller, lambda w: 10.0, geometric(0.7), rounds=200, per_forward_seconds=per_draft)
        picks[per_draft] = sorted(plain_picks(controller, plans))
    assert picks[0.2][len(picks[0.2]) // 2] > picks[3.0][len(picks[3.0]) // 2]
    controller = start(Auto(), rows=4)
    play(controller, lambda w: 40.0 + 3.0 * (w - 1), geometric(0.7), rounds=60)
    controller.keep_rows([0])
    plans = play(controller, lambda w: 10.0 + 0.2 * (w - 1), geometric(0.7), rounds=120)
    assert len(plans[-1].k) == 1
    k = max(plans[-1].k)
    assert controller.costs.verify(1, k + 1) == pytest.approx(10.0 + 0.2 * k, rel=0.1), "the single row's costs"


def test_auto_prices_a_block_drafter_as_one_forward_and_caps_k_at_its_block():
    """A draft forward costs 6 (a verification 10-14): one forward per draft pays for about 2
    drafts; a block drafter (7 drafts per forward) pays one forward for its whole block, so
    Auto drafts the whole block and never past it."""
    picks = {}
    for per_forward in (1, 7):
        controller = start(Auto(max_draft=12, forget_runs=1.0), per_forward=per_forward)
        plans = play(controller, lambda w: 10.0 + 0.5 * (w - 1), geometric(0.9), rounds=300,
                     per_forward_seconds=6.0, per_forward=per_forward)
        assert max(ks(plans)) <= 7 or per_forward == 1, "never past the block, exploring rounds included"
        picks[per_forward] = plain_picks(controller, plans)
        assert controller.pricing.draft(1) == pytest.approx(6.0, rel=0.05)
    assert max(picks[1]) <= 3
    assert set(picks[7]) == {7}


def test_auto_round_cost_shrugs_off_stalls():
    """Every tenth round stalls (20x): the estimates (the low median of recent rounds) keep a
    width's real cost."""
    controller = start(Auto(forget_runs=1.0))
    rng = random.Random(1)
    stalls = iter(range(10 ** 6))
    play(controller, lambda w: (10.0 + 0.5 * (w - 1)) * (20 if next(stalls) % 10 == 9 else 1), geometric(0.8),
         rounds=300, rng=rng)
    k = max(controller.plan(RoundState(1)).k)
    assert 10.0 + 0.5 * k <= controller.costs.verify(1, k + 1) < 1.2 * (10.0 + 0.5 * k)


def test_auto_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_draft, initial"):
        Auto(max_draft=3, initial=5)
    with pytest.raises(ValueError, match="prior_acceptance, forget_runs"):
        Auto(forget_runs=0.0)
    with pytest.raises(ValueError, match="explore_every"):
        Auto(explore_every=1)


def by_source(text_run, model_run):
    return lambda rng, source: (text_run if source == Source.TEXT else model_run)(rng)


def test_auto_drafts_the_text_where_it_is_accepted_more_and_the_model_does_not_run_for_nothing():
    """Batch 2: row 0's text offers 8 drafts that are accepted in long runs, row 1 has no
    match. Row 0 drafts its text, row 1 the model (the exploring rounds aside); once row 1
    matches too, the model stops."""
    controller = start(Auto(forget_runs=1.0), rows=2)
    verify = lambda w: 10.0 + 0.1 * (w - 1)  # noqa: E731
    runs = by_source(lambda rng: 8 if rng.random() < 0.9 else 0, geometric(0.6))
    plans = play(controller, verify, runs, offers=[8, 0], rounds=150, per_forward_seconds=0.5)
    late = [p for n, p in enumerate(plans, start=1) if n > 110 and n % controller.policy.explore_every]
    assert all(p.sources == [Source.TEXT, Source.MODEL] for p in late)
    assert controller.survival(Source.TEXT)[7] > 0.8
    assert controller.survival(Source.MODEL)[0] == pytest.approx(0.6, abs=0.1)
    assert controller.pricing.draft(1) == pytest.approx(0.5, rel=0.05)
    plans = play(controller, verify, runs, offers=[8, 8], rounds=60, per_forward_seconds=0.5)
    assert all(not p.model_runs and p.sources == [Source.TEXT] * 2 for p in plans[-20:])


def test_auto_times_a_plain_step_at_its_rows_before_drafting_wins_over_one():
    """A plain step costs less than the line through the drafting widths says (none of a
    verification's machinery). Where that line's price has Auto drafting, the round after the
    two that time the drafting widths takes a plain step (none is timed at these rows yet),
    and then plain steps win."""
    controller = start(Auto(forget_runs=1.0), rows=4)
    verify = lambda w: 4.0 if w == 1 else 10.0 + 1.0 * (w - 1)  # noqa: E731
    plans = play(controller, verify, geometric(0.5), rounds=120, per_forward_seconds=0.5)
    assert plans[0].model_runs and plans[1].model_runs and not plans[2].model_runs
    assert sum(not p.model_runs for p in plans[-40:]) >= 36


def test_auto_leaves_text_that_is_rarely_accepted_to_the_model():
    """Batch 1: the text matches every round but its drafts are never accepted, the model's
    often: the model drafts, and the text's cost (a wider verification) is not paid."""
    controller = start(Auto(forget_runs=1.0))
    plans = play(controller, lambda w: 10.0 + 0.5 * (w - 1), by_source(lambda rng: 0, geometric(0.8)), offers=[6],
                 rounds=200, per_forward_seconds=0.3)
    assert all(p.sources == [Source.MODEL] and max(p.k) >= 3 for p in plans[-40:])


def test_auto_drafts_no_text_where_its_width_costs_the_batch_more_than_it_gives():
    """Batch 8 on a step of weight reads: a verification of w tokens a row costs 2w - 1 steps
    past 1 token (each token of each row is arithmetic). Every row's text offers 12 drafts
    accepted as often as the model's one: the round does better with no text at all (width
    2 for everyone) than with any text chain, however short, so Auto drafts none, and its
    second round is the model alone at the narrowest width (the cost's slope measured). (A
    plain step would beat both here; it is kept out to test the text's cut alone.)"""

    @dataclasses.dataclass(frozen=True)
    class NoPlain(Auto):
        PLAIN_AFTER = 10 ** 9
        OPTIMISTIC = None

    controller = start(NoPlain(forget_runs=1.0), rows=8)
    verify = lambda w: 10.0 * (2 * w - 1)  # noqa: E731
    plans = play(controller, verify, geometric(0.6), offers=[12] * 8, rounds=120, per_forward_seconds=0.2)
    first = plans[0]
    assert 1 + max(len(t.tokens) if t else k for t, k in zip(first.text, first.k)) == 1 + controller.policy.initial
    assert plans[1].sources == [Source.MODEL] * 8 and max(plans[1].k) == 1, "the model alone at the narrowest width"
    late = [p for n, p in enumerate(plans, start=1) if n > 40 and n % controller.policy.explore_every]
    assert late and all(p.sources == [Source.MODEL] * 8 and p.k == [1] * 8 for p in late)


def test_finish_rate_prices_a_call_until_its_slowest_row_is_done():
    """finish_rate against the call worked out by hand: rows leave as they finish, a round of
    fewer rows costs its share of a full one; one row (or equal rows) is its plain rate."""
    from spec_ext.policies.estimates import finish_rate
    assert finish_rate([2.0], [10], 0.5, [1.0, 1.0]) == pytest.approx(2.0 / 0.5)
    assert finish_rate([1.5] * 4, [30] * 4, 2.0, [1.0] * 5) == pytest.approx(4 * 1.5 / 2.0)
    # rows of 12 tokens gaining 3 and 1.5 a round: both go 4 rounds, the slow one 4 more at 0.6 of a round
    seconds = 4 * 1.0 + 4 * 0.6
    assert finish_rate([3.0, 1.5], [12, 12], 1.0, [0.0, 0.6, 1.0]) == pytest.approx(24 / seconds)
    assert finish_rate([3.0, 1.0], [1, 12], 1.0, [0.0, 0.5, 1.0]) == pytest.approx(13 / (1 + 11 * 0.5))


def test_row_spread_learns_how_much_rows_differ_and_prices_the_slow_ones_below_the_pool():
    """RowSpread: rows whose first-draft rates are spread by a known amount give that variance
    back, net of the counting noise (rows of equal rates give ~0); its scales rank rows with
    no counts by the batch's expected order statistics (the slowest below the pool, the
    fastest above, the middle one of an odd batch at it) and rows with many counts by their
    own rates."""
    from spec_ext.policies.estimates import RowSpread
    rng = random.Random(0)
    rates = [0.5 + 0.15 * rng.uniform(-1.7, 1.7) for _ in range(400)]  # sd ~0.15
    spread = RowSpread(0.0, 1e-9)
    seen = [200.0] * len(rates)
    spread.add(seen, [sum(rng.random() < r for _ in range(200)) for r in rates])
    assert spread.variance ** 0.5 == pytest.approx(0.15, rel=0.15)
    equal = RowSpread(0.0, 1e-9)
    equal.add(seen, [sum(rng.random() < 0.5 for _ in range(200)) for _ in rates])
    assert equal.variance ** 0.5 < 0.04
    scales = RowSpread(0.01).scales(0.7, [0.0] * 5, [0.0] * 5)
    assert min(scales) < 0.85 and max(scales) > 1.15 and sorted(scales)[2] == pytest.approx(1.0)
    known = RowSpread(0.01).scales(0.7, [1000.0, 1000.0, 1000.0], [300.0, 700.0, 900.0])
    assert known == pytest.approx([0.3 / 0.7, 1.0, 0.9 / 0.7], abs=0.03)


def test_auto_prices_a_batch_by_its_slowest_rows():
    """Batch 8, a plain step 10, a verification of 2 tokens a row 14 and a draft forward 2
    (k = 1 costs 1.6 steps). Seven rows accept the first draft 9 times in 10, one row 2 in 10:
    by the pool's acceptance (~0.81) k = 1 pays (1.81 tokens for 1.6 steps), but the call
    lasts until the slow row is done, which gains 1.2 tokens for 1.6 steps: Auto, told each
    row's tokens left, steps plainly; told none, it drafts; with every row fast it drafts."""
    def late_plans(alphas, remaining):
        controller = start(Auto(), rows=8)
        rng, left, plans = random.Random(1), [1000] * 8, []
        for _ in range(120):
            plan = controller.plan(RoundState(8, None, remaining=list(left) if remaining else None))
            runs = [min(k, geometric(a)(rng)) for k, a in zip(plan.k, alphas)]
            width, steps = 1 + max(plan.k), max(plan.k)
            controller.observe(Report(plan, plan.sources, list(plan.k), runs, [[0] * (a + 1) for a in runs], width,
                                      seconds=(10.0 if width == 1 else 14.0 + 4.0 * (width - 2)) + 2.0 * steps,
                                      draft_seconds=2.0 * steps, draft_forwards=steps, draft_steps=steps))
            left = [max(1, n - 1 - a) for n, a in zip(left, runs)]
            plans.append(plan)
        return plans[60:]
    slow_row = [0.9] * 7 + [0.2]
    assert sum(p.plain for p in late_plans(slow_row, True)) >= 55
    assert sum(p.plain for p in late_plans(slow_row, False)) <= 5
    assert sum(p.plain for p in late_plans([0.9] * 8, True)) <= 5


def test_auto_steps_plainly_before_measuring_where_no_acceptance_would_pay():
    """Batch 4, a verification of w tokens costing 10 (2w - 1), a draft forward 3: after the
    two rounds that time the widths (8 first drafts, under PLAIN_AFTER), a plain step beats
    drafts even if 9 in 10 were accepted (OPTIMISTIC), so the third round is plain; where the
    verification is flat the model goes on drafting k = 1, but for the plain step that times
    one at these rows and the exploring rounds' one less (a plain step, kept measured)."""
    steep = start(Auto(), rows=4)
    plans = play(steep, lambda w: 10.0 * (2 * w - 1), geometric(0.5), offers=[0] * 4, rounds=4,
                 per_forward_seconds=3.0)
    assert plans[0].model_runs and plans[1].model_runs and plans[2].plain
    assert steep.accept[Source.MODEL].first_drafts < Auto.PLAIN_AFTER
    flat = start(Auto(), rows=4)
    plans = play(flat, lambda w: 10.0 + 0.1 * (w - 1), geometric(0.5), offers=[0] * 4, rounds=40,
                 per_forward_seconds=3.0)
    assert [n for n, p in enumerate(plans, start=1) if not p.model_runs] == [3, 16, 32]
    assert all(max(p.k) == 1 for n, p in enumerate(plans, start=1) if n > 3 and n % 8)


def test_auto_decodes_plainly_where_no_draft_pays_and_drafts_again_where_it_does():
    """Batch 8 on a step of weight reads (every verified token arithmetic), a model whose
    drafts are rarely accepted and cost 3 a forward, no text: a plain step (8 tokens for 10)
    beats any draft (k = 1: ~9.6 tokens for 33). Until the model's acceptance rests on
    PLAIN_AFTER first drafts (two rounds of 8 rows) the model drafts; then it drafts only where
    the plain steps earned it (their extra seconds at most EXPLORE_SHARE of the plain steps',
    give or take one such round); once its drafts turn good and the verification flat, those
    rounds measure it (a width's cost is the low median of its last 9 rounds: five of them turn
    it over) and drafting resumes. The next call of the batch, through the same
    memory, steps plainly from its first round: the costs and the evidence carried."""
    memory = Memory()
    controller = start(Auto(), rows=8, memory=memory)
    steep = lambda w: 10.0 * (2 * w - 1)  # noqa: E731
    plans = play(controller, steep, geometric(0.2), offers=[0] * 8, rounds=1500, per_forward_seconds=3.0)
    assert all(p.model_runs for p in plans[:2]) and any(p.plain for p in plans[2:8]), "plain once measured"
    late = plans[40:]
    drafting = [p for p in late if not p.plain]
    assert drafting and all(max(p.k) == 1 for p in drafting), "drafting rounds keep the acceptance measured"
    extra = sum(steep(1 + max(p.k)) + 3.0 * max(p.k) - steep(1) for p in drafting)
    budget = controller.policy.EXPLORE_SHARE * steep(1) * (len(late) - len(drafting))
    assert budget / 2 <= extra <= budget + steep(2) + 3.0, (extra, budget)
    assert controller.costs.verify(8, 1) == pytest.approx(10.0, rel=0.1)
    # plain runs: PLAIN_RUN after a drafting round, twice the last after a run, at most LONGEST_RUN
    planned = [p for i, p in enumerate(plans) if i == 0 or p is not plans[i - 1]]
    runs = [(p.steps, planned[i - 1]) for i, p in enumerate(planned) if i and p.plain and p.steps > 1]
    assert {n for n, _ in runs} == {4, 8, 16}, runs
    for (n, before), (last, _) in zip(runs[1:], runs):
        assert n == (Auto.PLAIN_RUN if before.model_runs else min(2 * last, Auto.LONGEST_RUN)), (n, last, before)
    controller.finish()
    again = start(Auto(), rows=8, memory=memory)
    plans_again = play(again, steep, geometric(0.2), offers=[0] * 8, rounds=4, per_forward_seconds=3.0)
    assert all(p.plain for p in plans_again), "the costs and the evidence carried: plain from the first round"
    flat = lambda w: 10.0 + 0.1 * (w - 1)  # noqa: E731
    plans = play(controller, flat, geometric(0.9), offers=[0] * 8, rounds=1200, per_forward_seconds=0.5)
    assert all(max(p.k) >= 2 for p in plans[-30:])


def test_auto_plans_a_plain_runs_steps_the_engine_did_not_take_without_weighing():
    """Where the engine takes fewer steps of a plain run than planned with the rows unchanged
    (the call's first round; beside a drafter that runs every round, one step a plan), Auto
    plans the rest as plain steps without weighing; where a row finished, it weighs again."""
    controller = start(Auto(), rows=8)
    steep = lambda w: 10.0 * (2 * w - 1)  # noqa: E731
    play(controller, steep, geometric(0.2), offers=[0] * 8, rounds=60, per_forward_seconds=3.0)
    weighed = []
    offers = controller._offers
    controller._offers = lambda state: weighed.append(state.rows) or offers(state)

    def one_step(plan, rows=8):
        controller.observe(Report(plan, [Source.NONE] * rows, [0] * rows, [0] * rows, [[0]] * rows, 1,
                                  seconds=steep(1)))

    plan = next(p for p in iter(lambda: controller.plan(RoundState(8, Text([0] * 8))), None) if p.plain)
    run = plan.steps
    assert Auto.PLAIN_RUN <= run <= Auto.LONGEST_RUN and weighed
    weighed.clear()
    for left in range(run - 1, 0, -1):
        one_step(plan)
        plan = controller.plan(RoundState(8, Text([0] * 8)))
        assert plan.plain and plan.steps == left and not weighed, (left, plan, weighed)
    one_step(plan)
    plan = controller.plan(RoundState(8, Text([0] * 8)))
    assert weighed and plan.plain and plan.steps == min(2 * run, Auto.LONGEST_RUN)
    weighed.clear()
    one_step(plan)  # (one step of four, then a row finishes)
    controller.keep_rows(list(range(7)))
    controller.plan(RoundState(7, Text([0] * 7)))
    assert weighed == [7]


@pytest.mark.parametrize("drafter", ["draft model", "head"])
def test_auto_with_plain_steps_in_the_loop_equals_the_target_and_its_drafts_catch_up(drafter):
    """In the loop, priced so that a plain step wins after PLAIN_AFTER rounds (a verification
    of w tokens costs w^2, a draft forward 1): the drafter then runs only in the exploring
    rounds (EXPLORE_SHARE raised: every few plain steps), each time after a stretch of plain
    steps, and its drafts are still accepted there
    (the draft model's cache, the head's features caught up with the committed text); the
    output equals the target's on ragged rows; a round whose model forwards follow plain steps
    (a catch-up over them) is reported as no draft step's cost (``warm`` False)."""
    from helpers import hf_greedy
    from spec_ext.policies.estimates import Pricing

    class SteepPricing(Pricing):
        def verify(self, rows, width):
            return float(width) ** 2

        def draft(self, steps, rows=1):
            return float(steps)

    plans, reports = [], []

    class Recording(AutoController):
        def __init__(self, policy, call):
            super().__init__(policy, call)
            self.pricing = SteepPricing(self.costs, True)

        def plan(self, state):
            plans.append(super().plan(state))
            return plans[-1]

        def observe(self, report):
            reports.append(report)
            super().observe(report)

    @dataclasses.dataclass(frozen=True)
    class Steep(Auto):
        EXPLORE_SHARE = 0.5  # a drafting round every few plain steps

        def start(self, call):
            return Recording(self, call)

    if drafter == "draft model":
        target = llama(97, 64, 2, seed=0, sharpen=4.0)
        draft, prompts = perturbed(target, 0.005, seed=1), [[5, 17, 33, 8], [7, 8, 9, 40, 2, 11]]
    else:  # the bundled pair's head, accepted 2-3 drafts a round on the demo prompt
        target, draft, prompts = bundled_head_pair()
    out = spec_ext.generate(target, draft, prompts, max_new_tokens=120, eos_token_id=[], policy=Steep())
    for b, p in enumerate(prompts):
        assert out.sequences[b, -120:].tolist() == hf_greedy(target, p, 120, eos=[]), b
    plain = [n for n, p in enumerate(plans) if p.plain]
    assert plain and len(plain) > (len(plans) - Auto.PLAIN_AFTER) // 2, plans
    model_runs = [a for r in reports[Auto.PLAIN_AFTER:] for a, s in zip(r.accepted, r.source) if s == Source.MODEL]
    assert model_runs and sum(model_runs) >= len(model_runs) // 4, model_runs  # (lost context: ~1 in 97)
    after_plain = [r.warm for n, r in enumerate(reports) if n - 1 in plain and r.draft_forwards]
    assert after_plain and not any(after_plain)


def bundled_head_pair():
    """The bundled target, its head and two ragged prompts of the demo text (its head accepts
    2-3 drafts a round there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from spec_ext.__main__ import DEMO_PROMPT
    from spec_ext.bundled import bundled_path
    from spec_ext.drafters import load
    target = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-target"), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(bundled_path("stdlib-target"))(DEMO_PROMPT).input_ids
    return target, load(bundled_path("stdlib-head"), target), [ids[:40], ids[:23]]


@pytest.mark.parametrize("drafter", ["draft model", "head"])
def test_a_plain_run_is_its_steps_under_one_plan_and_the_drafter_catches_up_as_after_each(drafter, monkeypatch):
    """A plain plan of ``steps`` n: the engine takes n plain steps (fewer where a row finishes:
    the run ends there), then the controller sees one report of them (``steps``; every step's
    token in ``committed``). The drafter, skipped for the run, catches
    up as it does after n plain plans of one step: the same drafts in every drafting round
    (the head's waiting features joined before one store write), each a fresh drafter's on the
    committed text; the output is the target's."""
    from helpers import hf_greedy
    from spec_ext.drafters import HeadDrafter, ModelDrafter
    from spec_ext.drafters.mixed import MixedDrafter
    from test_draft_fidelity import first_proposal, rows_of
    from spec_ext.policies import Controller, Policy

    RUN = 5  # plain steps, then a round of 3 drafts, over and over

    class Schedule(Controller):
        def __init__(self, policy, call):
            super().__init__(policy, call)
            self.step, self.reports = 0, []

        def plan(self, state):
            phase = self.step % (RUN + 1)
            if phase == RUN:
                return RoundPlan([3] * state.rows)
            return RoundPlan([0] * state.rows, steps=RUN - phase if self.policy.runs else 1)

        def observe(self, report):
            self.reports.append(report)
            self.step += report.steps

    @dataclasses.dataclass(frozen=True)
    class Scheduled(Policy):
        runs: bool = True

        def start(self, call):
            self.controllers.append(Schedule(self, call))
            return self.controllers[-1]

        @property
        def controllers(self):
            return CONTROLLERS[self.runs]

    CONTROLLERS = {True: [], False: []}
    if drafter == "draft model":
        target = llama(97, 64, 2, seed=0, sharpen=4.0)
        draft, prompts = perturbed(target, 0.001, seed=1), [[5, 17, 33, 8], [7, 8, 9, 40, 2, 11]]
    else:
        target, draft, prompts = bundled_head_pair()
    proposals = {True: [], False: []}
    propose = MixedDrafter.propose
    runs = {"now": True}

    def recording(self, seqs, roots, plan):
        proposal = propose(self, seqs, roots, plan)
        proposals[runs["now"]].append(([list(s) for s in seqs], rows_of(proposal)))
        return proposal

    monkeypatch.setattr(MixedDrafter, "propose", recording)
    new = 80
    outs = {}
    for runs["now"] in (True, False):
        outs[runs["now"]] = spec_ext.generate(target, draft, prompts, max_new_tokens=new, eos_token_id=[],
                                              policy=Scheduled(runs["now"]))
    for b, p in enumerate(prompts):
        assert outs[True].sequences[b, -new:].tolist() == hf_greedy(target, p, new, eos=[]), b
    assert proposals[True] == proposals[False] and len(proposals[True]) >= 8
    assert outs[True].stats.accepted > len(proposals[True]), outs[True].stats  # (drafts accepted after the runs)
    reports = CONTROLLERS[True][0].reports
    plain = [r for r in reports if r.plan.plain and r.timed]
    assert RUN in {r.steps for r in plain}
    for r in plain:
        assert [len(c) for c in r.committed] == [r.steps] * r.plan.rows and r.width == 1
        assert r.drafted == r.accepted == [0] * r.plan.rows and r.source == [Source.NONE] * r.plan.rows
    cut = [r for r in plain if r.steps < r.plan.steps]  # (rows accept unlike counts: one finishes first)
    assert cut, [(r.steps, r.plan.steps) for r in plain]
    assert outs[True].stats.target_calls == outs[False].stats.target_calls
    with pytest.raises(ValueError, match="steps: must be >= 1, got 0"):
        RoundPlan([0, 0], steps=0)
    monkeypatch.setattr(MixedDrafter, "propose", propose)
    fresh = (lambda: ModelDrafter(draft)) if drafter == "draft model" else (lambda: HeadDrafter(draft))
    for n, (seqs, proposed) in enumerate(proposals[True]):
        assert proposed == rows_of(first_proposal(target, fresh, spec_ext.policies.Fixed(3), seqs)), n


def test_auto_times_the_narrowest_width_second_beside_a_head_whose_first_forward_is_no_cost():
    """Beside a feature head the first round's forward is a catch-up over the prompt (``warm``
    False), so a draft forward's cost is unknown in the second round: that round is still the
    model alone at the narrowest width (the head at a batch of 8 otherwise kept verifying 4-6
    tokens a row, the slope never measured)."""
    controller = start(Auto(), rows=8, wait=1)
    plans = play(controller, lambda w: 10.0 * w, lambda rng, s: 0, offers=[12] * 8, rounds=3,
                 per_forward_seconds=1.0, warm=lambda n: n > 0)
    assert plans[0].sources == [Source.TEXT] * 8 and plans[0].model_runs
    assert plans[1].sources == [Source.MODEL] * 8 and plans[1].k == [1] * 8
    assert controller.pricing.draft(1) == pytest.approx(1.0)


def test_sampling_takes_the_cost_from_the_model_sizes_not_the_clock():
    """Sampling, the lengths decide how the random stream is split into rounds: the choices
    must not depend on timing (the reports' seconds), so that a seed reproduces the output."""
    target, draft = torch.nn.Linear(100, 100), torch.nn.Linear(30, 30)
    ratio = 930 / 10100

    def lengths(seconds):
        controller = start(Auto(), rows=2, greedy=False, target=target, draft=draft)
        chosen = []
        for n, accepted in enumerate([3, 0, 5, 2, 7, 1, 4, 4]):
            text = Text([5, 0] if accepted % 2 else [0, 0])
            plan = controller.plan(RoundState(2, text))
            drafted = [len(t.tokens) if t else k for t, k in zip(plan.text, plan.k)]
            chosen.append((plan.k, plan.sources))
            runs = [min(accepted, d) for d in drafted]
            controller.observe(Report(plan, plan.sources, drafted, runs, [[0] * (a + 1) for a in runs],
                                      1 + max(drafted), seconds=seconds(n), draft_seconds=seconds(n) / 3,
                                      draft_forwards=1, draft_steps=max(plan.k)))
        assert controller.pricing.draft(1) == pytest.approx(ratio) and controller.pricing.verify(2, 7) == 1.0
        return chosen

    steady = lengths(lambda n: 0.5)
    erratic = lengths(lambda n: random.random())
    assert steady == erratic
    assert any(max(k) > 0 for k, _ in steady) and any(s[0] == Source.TEXT for _, s in steady)


def test_auto_in_the_loop_drafts_the_text_where_it_repeats_and_stays_exact(monkeypatch):
    """The default beside a draft model: on a prompt that repeats itself the text drafts
    rounds (``stats.matched``); Auto(text=False) never does; both equal the target's greedy
    output, alone and in a ragged batch. Verifications are priced flat and drafts nearly free:
    whether this machine's timings make plain steps win (then nothing drafts) is not tested here."""
    from helpers import hf_greedy
    monkeypatch.setattr(Costs, "verify", lambda self, rows, width: 1.0)
    monkeypatch.setattr(Costs, "draft", lambda self, steps, sequential=True, rows=1: 0.01 * steps)
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.05, seed=1)
    prompts = [[5, 17, 33, 8, 40, 2] * 4, [7, 8, 9], [40, 2, 11, 40, 2]]
    expected = [hf_greedy(target, p, 40, eos=[]) for p in prompts]
    out = spec_ext.generate(target, draft, prompts, max_new_tokens=40, eos_token_id=[])
    for b, p in enumerate(prompts):
        assert out.sequences[b, -40:].tolist() == expected[b], b
    assert out.stats.row_matched[0] > 0 and out.stats.text_accepted > 0
    alone = spec_ext.generate(target, draft, prompts[:1], max_new_tokens=40, eos_token_id=[], policy=Auto(text=False))
    assert alone.sequences[0, -40:].tolist() == expected[0] and alone.stats.matched == 0


def test_auto_reads_the_texts_runs_off_the_committed_tokens_where_the_model_drafts():
    """Every round the model drafts (3 drafts), the text's offer is compared with what the
    target committed: the text's acceptance counts, per round with an offer, how many of its
    drafts could be compared and how many equalled the committed tokens, as the plain matcher
    over the committed text says (so a text that lost early is still measured)."""
    from spec_ext.policies import RoundPlan
    from spec_ext.policies.auto import _Round
    from spec_ext.reference import reference_occurrences
    seen = []

    class ModelOnly(AutoController):
        def plan(self, state):
            chains = [state.text.chain(r, self.policy.max_draft) for r in range(state.rows)]
            return RoundPlan([3] * state.rows, record=_Round(unused=chains, cache=[None] * state.rows))

        def observe(self, report):
            text = self.accept[Source.TEXT]
            run = text.run
            text.run = lambda n, a: (seen.append((n, a)), run(n, a))
            super().observe(report)
            del text.run

    @dataclasses.dataclass(frozen=True)
    class Forced(Auto):
        def start(self, call):
            return ModelOnly(self, call)

    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.005, seed=1)  # accepted about half the time: rounds commit 1-4 tokens
    for prompt in ([5, 17, 33, 8, 40, 2] * 4, [7, 8, 9, 7, 8, 3, 7]):
        seen.clear()
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=60, eos_token_id=[], policy=Forced())
        seq, pos, expected = out.sequences[0].tolist(), len(prompt), []
        for a in out.stats.accepted_lengths[:-1]:  # the last round may be cut at max_new_tokens
            history, committed = seq[:pos], seq[pos:pos + a + 1]
            _, starts = reference_occurrences(history, 2, 1)
            chain = history[starts[0]:starts[0] + 12] if starts else []
            if chain:
                n = min(len(chain), len(committed))
                expected.append((n, next((j for j in range(n) if chain[j] != committed[j]), n)))
            pos += a + 1
        assert seen[:len(expected)] == expected
        assert any(a == n > 1 for n, a in expected) and any(a < n for n, a in expected)


def test_a_draft_forward_is_priced_by_the_warm_rounds_alone():
    """The round in which the draft model first runs also reads the whole prompt into its
    cache, and the first after plain steps catches up over them: those rounds' forwards are
    reported cold (``warm`` False) and stay out of a draft step's cost, which the prefill of a
    long prompt inflated for the rest of the call; every other round's are in."""
    reports = []

    class Recording(AutoController):
        def observe(self, report):
            reports.append(report)
            super().observe(report)

    @dataclasses.dataclass(frozen=True)
    class Recorded(Auto):
        def start(self, call):
            return Recording(self, call)

    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.05, seed=1)
    for prompts in ([list(range(3, 90))], [list(range(3, 60)), [7, 8, 9]]):
        reports.clear()
        out = spec_ext.generate(target, draft, prompts, max_new_tokens=24, eos_token_id=[], policy=Recorded())
        drafting = [r for r in reports if r.draft_forwards]
        assert out.stats.rounds > 3 and len(drafting) >= 3 and not drafting[0].warm
        ran = False
        for r in reports:
            assert r.warm == ran or not r.draft_forwards
            ran = r.draft_forwards > 0


# ------------------------------------------------------------------- the rules' decisions
def test_heuristic_adds_two_after_a_round_that_accepted_every_draft_else_drops_one():
    controller = Heuristic(initial=5, max_draft=8).start(Call(3))

    def round_(drafted, accepted):
        plan = controller.plan(RoundState(len(drafted)))
        assert plan.k == drafted
        controller.observe(Report(plan, plan.sources, drafted, accepted, [[0]] * len(drafted), 1 + max(drafted)))
    round_([5, 5, 5], [5, 4, 0])
    round_([7, 4, 4], [7, 4, 1])
    round_([8, 6, 3], [8, 6, 0])  # row 0 at max_draft
    assert controller.plan(RoundState(3)).k == [8, 8, 2]
    controller.keep_rows([2, 0])
    round_([2, 8], [0, 1])
    round_([1, 7], [0, 0])
    assert controller.plan(RoundState(2)).k == [1, 6]  # never below 1


def test_heuristic_schedule_in_the_loop():
    """Each round's length follows from the previous round's outcome (batch 1, greedy)."""
    target = llama(97, 32, 1, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.01, seed=1)
    out = spec_ext.generate(target, draft, [[5, 17, 33]], max_new_tokens=60, eos_token_id=[],
                            policy=Heuristic(initial=3, max_draft=9))
    drafted, accepted = out.stats.draft_lengths, out.stats.accepted_lengths
    assert drafted[0] == 3
    expected, k = [], 3
    for n, a in zip(drafted, accepted):
        expected.append(k)
        k = min(9, k + 2) if a >= n else max(1, k - 1)
    assert drafted[:-1] == expected[:-1]  # the last round may be cut to the tokens left
    assert any(a == n for n, a in zip(drafted, accepted)) and any(a < n for n, a in zip(drafted, accepted))


def test_confidence_stops_a_row_once_its_tokens_probability_is_below_the_threshold():
    probs = torch.tensor([[0.75, 0.25, 0.0], [0.1, 0.55, 0.35], [0.2, 0.0, 0.8], [0.39, 0.3, 0.31]])
    tokens = torch.tensor([0, 1, 0, 0])  # row 2 proposed token 0 (0.2), not its likeliest

    def goes_on(policy, step=1):
        plan = plan_of(policy, 4)
        assert plan.stops and plan.k == [policy.max_draft] * 4
        return plan.keep_drafting(step, probs, tokens).tolist()
    assert goes_on(Confidence(threshold=0.7)) == [True, False, False, False]
    assert goes_on(Confidence()) == [True, True, False, False]  # 0.4
    assert goes_on(Confidence(threshold=0.1), 3) == [True, True, True, True]


def test_svip_stops_once_the_entropy_rule_says_so():
    """sqrt(c * H(q)) > h stops: with c = h = 1, once H(q) > 1 nat."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0],            # ln 2 = 0.693
                          [1 / 3, 1 / 3, 1 / 3, 0.0],      # ln 3 = 1.099
                          [1.0, 0.0, 0.0, 0.0],            # 0
                          [0.5, 0.25, 0.25, 0.0]])         # 1.040
    tokens = probs.argmax(-1)

    def goes_on(policy):
        return plan_of(policy, 4).keep_drafting(1, probs, tokens).tolist()
    assert goes_on(SVIP(c=1.0, h=1.0)) == [True, False, True, False]
    # the defaults c = 0.15, h = 0.3: stop once H > 0.6 nat
    assert goes_on(SVIP()) == [False, False, True, False]
    assert goes_on(SVIP(c=0.15, h=0.33)) == [True, False, True, False]


def test_fixed_and_trees_plan_as_their_settings_say():
    assert plan_of(spec_ext.policies.Fixed(3), 2).k == [3, 3] and not plan_of(spec_ext.policies.Fixed(3), 2).stops
    tree = plan_of(spec_ext.policies.Tree((2, 1)), 2).tree
    assert tree == TreeShape(branching=(2, 1)) and tree.parents == (-1, 0, 0, 1, 2) and tree.room == 4
    dynamic = plan_of(spec_ext.policies.DynamicTree(depth=3, top_k=2, nodes=5), 1).tree
    assert dynamic.dynamic and dynamic.max_depth == 3 and dynamic.room == max(4, 2 * 2 + 1)
    with pytest.raises(ValueError, match="k: must be an int >= 1"):
        spec_ext.policies.Fixed(0)
    with pytest.raises(ValueError, match="branching"):
        spec_ext.policies.Tree(())


def test_a_policy_with_a_tree_and_a_per_step_stop_is_refused_by_name():
    """``goes_on`` stops a chain's rows; a tree has no per-step stop: a policy with both is
    refused when a call starts, not grown whole."""
    @dataclasses.dataclass(frozen=True)
    class StoppingTree(spec_ext.policies.Tree):
        def goes_on(self, step, probs, tokens, hidden=None):
            return probs.amax(-1) > 0.5

    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    with pytest.raises(ValueError, match=r"policy: .*StoppingTree\(.*goes_on"):
        spec_ext.generate(target, perturbed(target, 0.001, seed=1), [[5, 17, 33, 8]], max_new_tokens=4,
                          policy=StoppingTree((2, 1)))
    plan = plan_of(spec_ext.policies.Tree((2, 1)), 1)  # the tree alone still plans
    assert plan.tree is not None and not plan.stops


def test_a_one_forward_drafters_slots_are_a_trees_depth_or_the_longest_chain():
    """``RoundPlan.slots``: a block drafter's (or P-EAGLE's) drafts per forward: a tree's
    depth, or a chain's longest budget with each row's capped at ``most``."""
    assert plan_of(spec_ext.policies.Tree((2, 1)), 2).slots(1) == (2, None)
    assert RoundPlan([3, 6, 0]).slots() == (6, [3, 6, 0]) and RoundPlan([3, 6, 0]).slots(4) == (4, [3, 4, 0])
    assert RoundPlan([2, 2], after_catch_up=lambda agreed: [1, 5]).slots(4) == (4, [1, 4])


def test_auto_drafts_the_text_beside_a_feature_head_greedy_and_sampling():
    """Beside a feature head (which waits out the rounds the text drafts alone) the text
    drafts its rows too: greedy equals the target on ragged rows with text rounds and head
    rounds (Auto), and the first 3 sampled tokens' joint law is the target's with rows of text
    and of the head mixed in every round (a policy that alternates them)."""
    from helpers import PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy
    from spec_ext.engine import Sampler
    from test_heads import echo_head
    target = llama(12, 32, 2, seed=2, sharpen=4.0)  # (one whose head drafts are accepted in the first rounds)
    head = echo_head(target, draft_vocab=10)
    prompts = [[5, 7, 3, 8, 5, 7, 3], [9, 4, 10], [3, 1, 2, 3, 1]]
    out = spec_ext.generate(target, head, prompts, max_new_tokens=40, eos_token_id=[])
    for b, prompt in enumerate(prompts):
        assert out.sequences[b, -40:].tolist() == hf_greedy(target, prompt, 40, eos=[]), b
    assert out.stats.matched > 0 and out.stats.accepted > out.stats.text_accepted > 0, out.stats
    from spec_ext.policies import Controller, Offer, RoundPlan, TextSettings

    class Alternating(Controller):
        """Even rows their text's chain (where it matches), the others the head's 3 drafts."""

        def plan(self, state):
            chains = [state.text.chain(r, 3) if r % 2 == 0 else [] for r in range(state.rows)]
            text = [Offer(Source.TEXT, tuple(c)) if c else None for c in chains]
            return RoundPlan([0 if t is not None else 3 for t in text], text)

    @dataclasses.dataclass(frozen=True)
    class Mixed(spec_ext.policies.Policy):
        def text_settings(self, has_model):
            return TextSettings()

        def start(self, call):
            return Alternating(self, call)

    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    head = echo_head(target, draft_vocab=5, noise=0.05, seed=4)
    out = spec_ext.generate(target, head, [PROMPT] * 20_000, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                            policy=Mixed(), seed=7)
    assert 0 < out.stats.text_accepted < out.stats.accepted < out.stats.drafted, out.stats
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(1.0)))
