"""The lengths the rule-based policies choose, on constructed inputs: Auto, Heuristic,
Confidence, SVIP. A wrong choice is still exact, so only these tests catch it (exactness
of every policy is in test_decoding, which runs each registered one)."""
import random
import time

import pytest
import torch

import spec_ext
from spec_ext.policies import SVIP, Auto, Confidence, Heuristic
from helpers import llama, perturbed


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_rounds(policy, clock, rounds, base, per_draft, accepted_run, seed=0):
    """Rounds that last base + per_draft * k seconds, whose accepted run is
    min(k, accepted_run(rng)); returns the k of every round."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = policy.plan()[0]
        clock.now += base + per_draft * k
        policy.observe([k], [min(k, accepted_run(rng))])
        chosen.append(k)
    return chosen


def geometric(alpha):
    """Runs of drafts each accepted with chance alpha until the first miss."""
    def run(rng):
        n = 0
        while n < 64 and rng.random() < alpha:
            n += 1
        return n
    return run


def plain_picks(chosen, last=80):
    """The k of the late rounds that do not explore (round numbers 0 and 2 mod 4)."""
    return [k for n, k in list(enumerate(chosen, start=1))[-last:] if n % 4 in (0, 2)]


def test_auto_measures_runs_and_round_cost_and_maximises_tokens_per_second():
    clock = FakeClock()
    policy = Auto(max_draft=12, initial=2, forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    chosen = run_rounds(policy, clock, 400, 10.0, 0.5, geometric(0.8))
    assert chosen[:3] == [3, 2, 1], "the initial k, explored around, until three rounds are timed"
    base, per_draft = policy.round_cost()
    assert (base, per_draft) == (pytest.approx(10.0), pytest.approx(0.5))
    survival = policy.survival()
    assert survival[:4] == pytest.approx([0.8, 0.64, 0.512, 0.41], abs=0.05)
    true_rate = {k: sum(0.8 ** i for i in range(k + 1)) / (10.0 + 0.5 * k) for k in range(1, 13)}
    best = max(true_rate.values())
    plain = plain_picks(chosen)
    assert min(plain) > 2 and all(true_rate[k] >= 0.98 * best for k in plain), plain
    late = list(enumerate(chosen, start=1))[-80:]
    for n, k in late[1:]:
        if n % 4 in (1, 3):  # every fourth round tries one more, every fourth one less
            assert k - chosen[n - 2] == (1 if n % 4 == 1 else -1) or k in (1, 12)


def test_auto_values_bursty_runs_as_they_are():
    """Runs of 0 or >= 12 (a draft either gets a passage or not): the mean acceptance of a
    geometric law would say stop early, the runs say draft to the end."""
    clock = FakeClock()
    policy = Auto(max_draft=12, forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    chosen = run_rounds(policy, clock, 600, 10.0, 1.5, lambda rng: 0 if rng.random() < 0.4 else 12)
    assert min(plain_picks(chosen)) >= 11
    assert policy.survival()[-1] == pytest.approx(0.6, abs=0.1)


def test_auto_drafts_less_when_drafts_cost_more_and_follows_rows_finishing():
    picks = {}
    for per_draft in (0.2, 3.0):
        clock = FakeClock()
        policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
        policy.start(1)
        picks[per_draft] = sorted(plain_picks(run_rounds(policy, clock, 200, 10.0, per_draft, geometric(0.7))))
    assert picks[0.2][len(picks[0.2]) // 2] > picks[3.0][len(picks[3.0]) // 2]
    clock = FakeClock()
    policy = Auto(clock=clock)  # forgets: the cost measured before the batch shrank fades
    policy.start(4)
    run_rounds(policy, clock, 60, 40.0, 3.0, geometric(0.7))
    policy.keep_rows([0])
    assert len(policy.plan()) == 1
    run_rounds(policy, clock, 120, 10.0, 0.2, geometric(0.7))
    assert policy.round_cost() == (pytest.approx(10.0, rel=0.1), pytest.approx(0.2, abs=0.1))


def test_auto_round_cost_shrugs_off_stalls():
    clock = FakeClock()
    policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    rng = random.Random(1)
    for n in range(300):
        k = policy.plan()[0]
        clock.now += (10.0 + 0.5 * k) * (20 if n % 10 == 9 else 1)  # every tenth round stalls
        policy.observe([k], [min(k, geometric(0.8)(rng))])
    base, per_draft = policy.round_cost()  # uncapped, this run fits 20.4 + 3.3 k
    assert 10.0 <= base < 12.0 and 0.3 < per_draft < 1.5


def test_auto_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_draft, initial"):
        Auto(max_draft=3, initial=5)
    with pytest.raises(ValueError, match="prior_acceptance, forget_runs, forget_cost"):
        Auto(forget_cost=0.0)


def test_sampling_takes_the_cost_from_the_model_sizes_not_the_clock():
    """Sampling, the lengths decide how the random stream is split into rounds: the choices
    must not depend on timing, so that a seed reproduces the output."""
    target, draft = torch.nn.Linear(100, 100), torch.nn.Linear(30, 30)
    ratio = 930 / 10100

    def lengths(clock):
        policy = Auto(clock=clock)
        policy.bind(target, draft)
        policy.start(1, greedy=False)
        chosen = []
        for accepted in [3, 0, 5, 2, 7, 1, 4, 4]:
            k = policy.plan()[0]
            chosen.append(k)
            policy.observe([k], [min(accepted, k)])
        assert policy.round_cost() == (1.0, ratio)
        return chosen, policy

    ticks = iter(range(1000))
    steady, policy = lengths(lambda: next(ticks) * 0.01)
    erratic = lengths(lambda: time.perf_counter() * 1e3)[0]
    assert steady == erratic
    tokens = [1.0]
    for chance in policy.survival():
        tokens.append(tokens[-1] + chance)
    best = max(range(1, policy.max_draft + 1), key=lambda k: tokens[k] / (1 + ratio * k))
    assert policy.plan()[0] == min(policy.max_draft, max(1, best + {1: 1, 3: -1}.get(9 % 4, 0)))


# ------------------------------------------------------------------- the rules' decisions
def test_heuristic_adds_two_after_a_round_that_accepted_every_draft_else_drops_one():
    policy = Heuristic(initial=5, max_draft=8)
    policy.start(3)
    assert policy.plan() == [5, 5, 5]
    policy.observe([5, 5, 5], [5, 4, 0])
    assert policy.plan() == [7, 4, 4]
    policy.observe([7, 4, 4], [7, 4, 1])
    assert policy.plan() == [8, 6, 3]  # row 0 at max_draft
    policy.observe([8, 6, 3], [8, 6, 0])
    assert policy.plan() == [8, 8, 2]
    policy.keep_rows([2, 0])
    policy.observe([2, 8], [0, 1])
    policy.observe([1, 7], [0, 0])
    assert policy.plan() == [1, 6]  # never below 1


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
    assert Confidence(threshold=0.7).keep_drafting(1, probs, tokens).tolist() == [True, False, False, False]
    assert Confidence().keep_drafting(1, probs, tokens).tolist() == [True, True, False, False]  # 0.4
    assert Confidence(threshold=0.1).keep_drafting(3, probs, tokens).tolist() == [True, True, True, True]


def test_svip_stops_once_the_entropy_rule_says_so():
    """sqrt(c * H(q)) > h stops: with c = h = 1, once H(q) > 1 nat."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0],            # ln 2 = 0.693
                          [1 / 3, 1 / 3, 1 / 3, 0.0],      # ln 3 = 1.099
                          [1.0, 0.0, 0.0, 0.0],            # 0
                          [0.5, 0.25, 0.25, 0.0]])         # 1.040
    tokens = probs.argmax(-1)
    assert SVIP(c=1.0, h=1.0).keep_drafting(1, probs, tokens).tolist() == [True, False, True, False]
    # the defaults c = 0.15, h = 0.3: stop once H > 0.6 nat
    assert SVIP().keep_drafting(1, probs, tokens).tolist() == [False, False, True, False]
    assert SVIP(c=0.15, h=0.33).keep_drafting(1, probs, tokens).tolist() == [True, False, True, False]


def test_auto_picks_the_k_with_most_tokens_per_unit_cost_from_counted_runs():
    """Sampling: the cost is 1 + k * (draft / target parameters) = 1 + k/2 here; runs are
    counted by hand (prior: 0.5 accepted of 1 reached at every depth)."""
    policy = Auto(max_draft=6, initial=4, forget_runs=1.0)
    policy.bind(torch.nn.Linear(10, 10), torch.nn.Linear(10, 5))  # 110 and 55 parameters
    policy.start(1, greedy=False)
    for run in [6, 6, 6, 6, 2, 2, 2, 2, 0, 0]:  # ten rounds of 6 drafts
        policy.plan()
        policy.observe([6], [run])
    # depth j: (0.5 + rounds that accepted >= j) / (1 + rounds that reached j)
    passed = [0.5 + 8, 0.5 + 8, 0.5 + 4, 0.5 + 4, 0.5 + 4, 0.5 + 4]
    reached = [1 + 10, 1 + 8, 1 + 8, 1 + 4, 1 + 4, 1 + 4]
    survival, alive = [], 1.0
    for a, r in zip(passed, reached):
        alive *= a / r
        survival.append(alive)
    assert policy.survival() == pytest.approx(survival)
    rate = {k: (1 + sum(survival[:k])) / (1 + k / 2) for k in range(1, 7)}
    best = max(rate, key=rate.get)
    assert best == 2 and rate[2] > 1.05 * max(rate[1], rate[3])
    assert policy.round_cost() == (1.0, 0.5)
    # rounds 11, 12, 13: the 11th explores one less, the 12th takes the best, the 13th one more
    assert [policy.plan()[0] for _ in range(3)] == [best - 1, best, best + 1]
