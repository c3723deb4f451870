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


def run_rounds(policy, clock, rounds, verify, accepted_run, per_draft=0.0, seed=0):
    """Rounds of the model alone (plan) that last verify(k + 1) + per_draft * k seconds,
    whose accepted run is min(k, accepted_run(rng)); returns the k of every round."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = policy.plan()[0]
        clock.now += verify(k + 1) + per_draft * k
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


def plain_picks(policy, chosen, last=80):
    """The k of the late rounds that do not explore."""
    every = policy.explore_every
    start = len(chosen) - last
    return [k for n, k in enumerate(chosen[start:], start=start + 1) if n % every]


def test_auto_prices_each_width_as_measured_and_maximises_tokens_per_second():
    """A verification's cost by width is irregular where the step is weight reads: here 5
    tokens cost what one does and 6 cost 2.5x. A line a + b*k through those costs would
    draft past the step; the table per width stops at 4 drafts."""
    clock = FakeClock()
    policy = Auto(max_draft=12, forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    verify = lambda w: 10.0 if w <= 5 else 25.0  # noqa: E731
    chosen = run_rounds(policy, clock, 400, verify, geometric(0.9))
    assert chosen[0] == 4, "the initial k until a round is timed"
    assert chosen[1] == 1, "then the narrowest chain, so that two widths give the cost's slope"
    assert policy.survival()[:4] == pytest.approx([0.9, 0.81, 0.729, 0.656], abs=0.05)
    for w in set(k + 1 for k in chosen):
        assert policy.verify_cost(w) == pytest.approx(verify(w))
    assert policy.draft_cost() is None, "no drafter reported its forwards: the widths' costs hold them"
    assert set(plain_picks(policy, chosen)) == {4}
    every = policy.explore_every
    explored = {n: k for n, k in enumerate(chosen, start=1) if n > 100 and n % every == 0}
    assert set(explored.values()) == {3, 5}, "every explore_every-th round tries one more, then one less"


def test_auto_reads_a_chains_costs_from_the_widths_a_chain_verifies():
    """A round that verified a tree wider than any chain (a Suffix cache tree of 32 tokens,
    reported through ``verifies``, on the tree path: 90 s where a chain of 32 would take 25.5)
    stays timed at its own cost for the tree's pricing (a later one is not cut to 3x the chains'
    line), but the chain's widths are read from the chains: it times 2 tokens, then initial + 1,
    and prices 8 tokens on their line (13.5 s), where the line through the tree's width priced
    them at about 26 s."""
    clock = FakeClock()
    policy = Auto(max_draft=12, forget_cost=1.0, clock=clock)
    policy.start(1)
    verify = lambda w: 10.0 + 0.5 * (w - 1)  # noqa: E731

    def tree_round():
        policy.plan()
        policy.verifies(32)
        clock.now += 90.0
        policy.observe([0], [0])  # no model drafts
    tree_round()
    chosen = []
    for _ in range(3):
        k = policy.choose([0])[0]
        assert policy.plan() == [k]  # the drafter's call for the model's drafts (no second tick)
        clock.now += verify(k + 1)
        policy.observe([k], [k])
        chosen.append(k)
    assert chosen[:2] == [1, 4], chosen
    assert policy.verify_cost(8) == pytest.approx(verify(8))
    tree_round()
    policy.choose([0])  # times the second tree round
    n, seconds = policy.timed_widths()[32]
    assert n == 2 and seconds / n == pytest.approx(90.0)


def test_auto_values_bursty_runs_as_they_are():
    """Runs of 0 or >= 12 (a draft either gets a passage or not): the mean acceptance of a
    geometric law would say stop early, the runs say draft to the end."""
    clock = FakeClock()
    policy = Auto(max_draft=12, forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    chosen = run_rounds(policy, clock, 600, lambda w: 10.0 + 1.5 * (w - 1),
                        lambda rng: 0 if rng.random() < 0.4 else 12)
    assert min(plain_picks(policy, chosen)) >= 11
    assert policy.survival()[-1] == pytest.approx(0.6, abs=0.1)


def test_auto_prices_a_depth_rarely_reached_like_the_drafts_after_an_accepted_one():
    """Rounds of 2 drafts, the second accepted 90% of the time after the first: drafts 3-12,
    never reached, are priced at that pooled rate, not at the flat prior (0.5); two failures
    at depth 3 price that depth down, not the depths past it."""
    policy = Auto(forget_runs=1.0)
    policy.start(1)
    rng = random.Random(0)
    for _ in range(200):
        first = rng.random() < 0.8
        policy.observe([2], [0 if not first else 2 if rng.random() < 0.9 else 1])
    s = policy.survival()
    assert s[0] == pytest.approx(0.8, abs=0.06) and s[1] / s[0] == pytest.approx(0.9, abs=0.05)
    for j in range(2, 12):
        assert s[j] / s[j - 1] == pytest.approx(s[1] / s[0], abs=0.01), j
    policy.observe([3], [2])
    policy.observe([3], [2])
    s = policy.survival()
    assert s[2] / s[1] < 0.4 and s[3] / s[2] == pytest.approx(s[1] / s[0], abs=0.02)


def test_auto_grows_a_chain_a_draft_a_round_past_the_depths_it_measured():
    """Drafts 1-2 always accepted and 3 never (a block drafter's later slots): the pooled rate
    past the first draft (about 0.6 after round 1) prices every depth never reached, and a
    verification of 10 + 0.2 k then made the third round draft 12. Each round's k is at most
    one past the deepest draft reached before it (one more in an exploring round), and it
    settles at 2; where drafts are accepted 97% of the time it still grows to the longest, a
    draft a round."""
    for accepted, longest in ((lambda rng: 2, 2), (geometric(0.97), 12)):
        clock = FakeClock()
        policy = Auto(max_draft=12, forget_runs=1.0, forget_cost=1.0, clock=clock)
        policy.start(1)
        rng, deepest, chosen = random.Random(0), 0, []
        for r in range(150):
            k = policy.plan()[0]
            if r >= 2:
                explores = policy._rounds % (2 * policy.explore_every) == policy.explore_every
                assert k <= deepest + 1 + explores, (r, k, deepest)
            a = min(k, accepted(rng))
            deepest = max(deepest, min(a + 1, k))
            clock.now += 10.0 + 0.2 * k
            policy.observe([k], [a])
            chosen.append(k)
        assert max(plain_picks(policy, chosen)) == longest, chosen


def test_auto_kept_across_calls_starts_each_from_the_last_calls_estimates():
    """A call of 60 rounds (5 tokens cost what 1 does, 6 cost 2.5x; drafts accepted 90%)
    measures its way from the initial k (2) and the narrowest chain to k = 4. The next call
    of the same batch size starts at 4 with no measuring round (a sampled call in between starts
    afresh and changes nothing); a call of another batch size
    carries the acceptance but not the costs (the initial k, then the narrowest); bound to
    another draft, the policy starts cold."""
    clock = FakeClock()
    policy = Auto(max_draft=12, initial=2, forget_runs=1.0, forget_cost=1.0, clock=clock)
    target, draft = torch.nn.Linear(4, 4), torch.nn.Linear(2, 2)
    policy.bind(target, draft)
    verify = lambda w: 10.0 if w <= 5 else 25.0  # noqa: E731

    def call(rows, rounds=60, accepted=geometric(0.9)):
        policy.start(rows)
        return run_rounds(policy, clock, rounds, verify, accepted)
    first = call(1)
    assert first[:2] == [2, 1] and first[-1] == 4, first
    assert call(1, 3) == [4, 4, 4]
    for _ in range(2):  # a sampled call starts afresh, after a sampled call too (and leaves the greedy calls' be)
        policy.start(1, greedy=False)
        assert policy.survival()[0] == pytest.approx(0.5), "the prior alone"
        for _ in range(3):
            policy.observe(policy.plan(), [0])
    assert call(1, 3) == [4, 4, 4]
    assert call(2, 3, accepted=lambda rng: 0)[:2] == [2, 1]
    # 3 rejected first drafts after ~100 mostly accepted: from the prior alone it would read 1/8
    assert policy.survival()[0] > 0.75, "the acceptance carried"
    assert call(1, 2) == [4, 4], "each batch size's costs kept apart"
    # a batch's costs carried as they stood when its first row finished, not its last rows' (cheaper) rounds
    policy.start(2)
    run_rounds(policy, clock, 20, verify, geometric(0.9))
    full_batch = [policy.verify_cost(w) for w in range(1, 8)]
    policy.keep_rows([1])
    run_rounds(policy, clock, 40, lambda w: 1.0, geometric(0.9))
    assert policy.verify_cost(5) < 6.0, "the last row's rounds"
    policy.start(2)
    assert [policy.verify_cost(w) for w in range(1, 8)] == full_batch
    policy.bind(target, torch.nn.Linear(2, 2))
    assert call(1, 2, accepted=lambda rng: 0) == [2, 1]
    assert policy.survival()[0] < 0.3, "a new draft's acceptance: the prior and 2 rejections"


def test_auto_kept_by_accelerate_stays_exact_and_a_seed_reproduces_a_sampled_call():
    """One accelerate object (its Auto kept across calls) through greedy calls of batch 1 and
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


def test_auto_drafts_less_when_drafts_cost_more_and_follows_rows_finishing():
    picks = {}
    for per_draft in (0.2, 3.0):
        clock = FakeClock()
        policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
        policy.start(1)
        chosen = run_rounds(policy, clock, 200, lambda w: 10.0 + per_draft * (w - 1), geometric(0.7))
        picks[per_draft] = sorted(plain_picks(policy, chosen))
    assert picks[0.2][len(picks[0.2]) // 2] > picks[3.0][len(picks[3.0]) // 2]
    clock = FakeClock()
    policy = Auto(clock=clock)  # forgets: the cost measured before the batch shrank fades
    policy.start(4)
    run_rounds(policy, clock, 60, lambda w: 40.0 + 3.0 * (w - 1), geometric(0.7))
    policy.keep_rows([0])
    assert len(policy.plan()) == 1
    chosen = run_rounds(policy, clock, 120, lambda w: 10.0 + 0.2 * (w - 1), geometric(0.7))
    assert policy.verify_cost(chosen[-1] + 1) == pytest.approx(10.0 + 0.2 * chosen[-1], rel=0.1)


def test_auto_prices_a_block_drafter_as_one_forward_and_caps_k_at_its_block():
    """A draft forward costs 6 (a verification 10-14): one forward per draft pays for about 2
    drafts; a block drafter (7 drafts per forward) pays one forward for its whole block, so
    Auto drafts the whole block and never past it."""
    picks = {}
    for per_forward in (1, 7):
        clock = FakeClock()
        policy = Auto(max_draft=12, forget_runs=1.0, forget_cost=1.0, clock=clock)
        policy.bind(torch.nn.Linear(2, 2), None)
        policy.see_draft_shape(per_forward)
        policy.start(1)
        rng, chosen = random.Random(0), []
        for _ in range(300):
            k = policy.plan()[0]
            forwards = policy.draft_forwards(k)
            policy.drafted(6.0 * forwards, forwards)
            clock.now += 10.0 + 0.5 * k + 6.0 * forwards
            policy.observe([k], [min(k, geometric(0.9)(rng))])
            chosen.append(k)
        assert max(chosen) <= 7 or per_forward == 1, "never past the block, exploring rounds included"
        picks[per_forward] = plain_picks(policy, chosen)
        assert policy.draft_cost() == pytest.approx(6.0)
    assert max(picks[1]) <= 3
    assert set(picks[7]) == {7}


def test_auto_round_cost_shrugs_off_stalls():
    clock = FakeClock()
    policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    rng = random.Random(1)
    for n in range(300):
        k = policy.plan()[0]
        clock.now += (10.0 + 0.5 * k) * (20 if n % 10 == 9 else 1)  # every tenth round stalls
        policy.observe([k], [min(k, geometric(0.8)(rng))])
    k = policy.plan()[0]
    assert 10.0 + 0.5 * k <= policy.verify_cost(k + 1) < 1.5 * (10.0 + 0.5 * k)  # uncapped: 2.9x


def test_auto_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_draft, initial"):
        Auto(max_draft=3, initial=5)
    with pytest.raises(ValueError, match="prior_acceptance, forget_runs, forget_cost"):
        Auto(forget_cost=0.0)
    with pytest.raises(ValueError, match="explore_every"):
        Auto(explore_every=1)


def choose_rounds(policy, clock, rounds, matches, text_run, model_run, verify, per_forward, seed=0):
    """Rounds under :meth:`Auto.choose`: row b's text offers ``matches[b]`` drafts; a round
    lasts verify(width) + per_forward * k (the drafter reports the forwards' seconds);
    text and model drafts are accepted for runs drawn by ``text_run`` and ``model_run``.
    Returns every round's (k, rows by text, width)."""
    rng = random.Random(seed)
    choices = []
    for _ in range(rounds):
        k, use, longest = policy.choose(list(matches))
        drafted = [min(m, longest) if u else k for m, u in zip(matches, use)]
        width = 1 + max(drafted)
        if k:
            policy.drafted(per_forward * k, k)
        clock.now += verify(width) + per_forward * k
        accepted = [min(n, (text_run if u else model_run)(rng)) for n, u in zip(drafted, use)]
        policy.observe(drafted, accepted)
        choices.append((k, use, width))
    return choices


def test_auto_drafts_the_text_where_it_is_accepted_more_and_the_model_does_not_run_for_nothing():
    """Batch 2: row 0's text offers 8 drafts that are accepted in long runs, row 1 has no
    match. Row 0 drafts its text, row 1 the model; once row 1 matches too, the model stops."""
    clock = FakeClock()
    policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(2)
    verify = lambda w: 10.0 + 0.1 * (w - 1)  # noqa: E731
    choices = choose_rounds(policy, clock, 150, [8, 0], lambda rng: 8 if rng.random() < 0.9 else 0,
                            geometric(0.6), verify, per_forward=0.5)
    late = choices[-40:]
    assert all(use == [True, False] for _, use, _ in late)
    assert all(k >= 1 for k, _, _ in late)
    assert policy.survival("text")[7] > 0.8 and policy.survival("model")[0] == pytest.approx(0.6, abs=0.1)
    assert policy.draft_cost() == pytest.approx(0.5)
    choices = choose_rounds(policy, clock, 60, [8, 8], lambda rng: 8 if rng.random() < 0.9 else 0,
                            geometric(0.6), verify, per_forward=0.5)
    assert all(k == 0 and use == [True, True] for k, use, _ in choices[-20:])


def test_auto_leaves_text_that_is_rarely_accepted_to_the_model():
    """Batch 1: the text matches every round but its drafts are never accepted, the model's
    often: the model drafts, and the text's cost (a wider verification) is not paid."""
    clock = FakeClock()
    policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.start(1)
    choices = choose_rounds(policy, clock, 200, [6], lambda rng: 0, geometric(0.8),
                            lambda w: 10.0 + 0.5 * (w - 1), per_forward=0.3)
    assert all(use == [False] and k >= 3 for k, use, _ in choices[-40:])


def test_auto_drafts_no_text_where_its_width_costs_the_batch_more_than_it_gives():
    """Batch 8 on a step of weight reads: a verification of w tokens a row costs 2w - 1 steps
    past 1 token (each token of each row is arithmetic). Every row's text offers 12 drafts
    accepted as often as the model's one: the round does better with no text at all (width
    2 for everyone) than with any text chain, however short, so Auto drafts none, and its
    second round is the model alone at the narrowest width (the cost's slope measured). (A
    plain step would beat both here; it is kept out to test the text's cut alone.)"""
    clock = FakeClock()
    policy = Auto(forget_runs=1.0, forget_cost=1.0, clock=clock)
    policy.PLAIN_AFTER = 10 ** 9
    policy.start(8)
    verify = lambda w: 10.0 * (2 * w - 1)  # noqa: E731
    choices = choose_rounds(policy, clock, 120, [12] * 8, geometric(0.6), geometric(0.6), verify, per_forward=0.2)
    assert choices[0][2] == 1 + policy.initial, "the first round: text and model to the initial k"
    assert choices[1][:2] == (1, [False] * 8), "the second: the model alone at the narrowest width"
    plain = [c for n, c in enumerate(choices, start=1) if n > 40 and n % policy.explore_every]
    assert plain and all(c == (1, [False] * 8, 2) for c in plain)


def test_auto_decodes_plainly_where_no_draft_pays_and_drafts_again_where_it_does():
    """Batch 8 on a step of weight reads (every verified token arithmetic), a model whose
    drafts are rarely accepted and cost 3 a forward, no text: a plain step (8 tokens for 10)
    beats any draft (k = 1: ~9.6 tokens for 33). Before PLAIN_AFTER rounds and in every
    explore_every-th round the model drafts; once its drafts turn good and the verification
    flat, those rounds measure it and drafting resumes."""
    clock = FakeClock()
    policy = Auto(clock=clock)
    policy.start(8)
    steep = lambda w: 10.0 * (2 * w - 1)  # noqa: E731
    choices = choose_rounds(policy, clock, 160, [0] * 8, geometric(0.0), geometric(0.2), steep, per_forward=3.0)
    assert all(k > 0 for k, _, _ in choices[:Auto.PLAIN_AFTER]), "no plain step before PLAIN_AFTER rounds"
    late = list(enumerate(choices, start=1))[40:]
    assert all(c == (0, [False] * 8, 1) for n, c in late if n % policy.explore_every)
    assert all(c[0] >= 1 for n, c in late if n % policy.explore_every == 0), "the exploring rounds draft"
    assert policy.verify_cost(1) == pytest.approx(10.0)
    flat = lambda w: 10.0 + 0.1 * (w - 1)  # noqa: E731
    choices = choose_rounds(policy, clock, 120, [0] * 8, geometric(0.0), geometric(0.9), flat, per_forward=0.5)
    assert all(k >= 2 for k, _, _ in choices[-30:])


@pytest.mark.parametrize("drafter", ["draft model", "head"])
def test_auto_with_plain_steps_in_the_loop_equals_the_target_and_its_drafts_catch_up(drafter):
    """In the loop, priced so that a plain step wins after PLAIN_AFTER rounds (a verification
    of w tokens costs w^2, a draft forward 1): the drafter then runs only in the exploring
    rounds, each time after a stretch of plain steps, and its drafts are still accepted there
    (the draft model's cache, the head's features caught up with the committed text); the
    output equals the target's on ragged rows; the draft model's forward after plain steps (a
    catch-up over them) is not averaged into a forward's cost."""
    from helpers import hf_greedy

    class Steep(Auto):
        def verify_cost(self, width):
            return float(width) ** 2

        def draft_cost(self):
            return 1.0

        def choose(self, lengths, forwards_without_model=0):
            choice = super().choose(lengths, forwards_without_model)
            rounds.append(choice)
            return choice

        def observe(self, num_draft, num_accepted):
            k, use, _ = rounds[-1]
            model_runs.extend(a for n, a, u in zip(num_draft, num_accepted, use)
                              if len(rounds) > Auto.PLAIN_AFTER and k > 0 and not u)
            super().observe(num_draft, num_accepted)

        def drafted(self, seconds, forwards, averaged=True):
            reports.append((len(rounds), averaged))
            super().drafted(seconds, forwards, averaged)

    if drafter == "draft model":
        target = llama(97, 64, 2, seed=0, sharpen=4.0)
        draft, prompts = perturbed(target, 0.005, seed=1), [[5, 17, 33, 8], [7, 8, 9, 40, 2, 11]]
    else:  # the bundled pair's head, accepted 2-3 drafts a round on the demo prompt
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from spec_ext.__main__ import DEMO_PROMPT
        from spec_ext.bundled import bundled_path
        from spec_ext.drafters import load
        target = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-target"), dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(bundled_path("stdlib-target"))(DEMO_PROMPT).input_ids
        draft, prompts = load(bundled_path("stdlib-head"), target), [ids[:40], ids[:23]]
    rounds, model_runs, reports = [], [], []
    out = spec_ext.generate(target, draft, prompts, max_new_tokens=120, eos_token_id=[], policy=Steep(text=True))
    for b, p in enumerate(prompts):
        assert out.sequences[b, -120:].tolist() == hf_greedy(target, p, 120, eos=[]), b
    plain = [n for n, (k, use, _) in enumerate(rounds, start=1) if k == 0 and not any(use)]
    assert plain and min(plain) > Auto.PLAIN_AFTER and len(plain) > (len(rounds) - Auto.PLAIN_AFTER) // 2, rounds
    assert model_runs and sum(model_runs) > len(model_runs) // 2, model_runs
    if drafter == "draft model":
        after_plain = [averaged for n, averaged in reports if n - 1 in plain]
        assert after_plain and not any(after_plain)


def test_auto_times_the_narrowest_width_second_beside_a_head_whose_first_forward_is_no_cost():
    """Beside a feature head the first round's forward is a catch-up over the prompt, reported
    as no forward's cost (``averaged=False``), so a draft forward's cost is unknown in the
    second round: that round is still the model alone at the narrowest width (the head at a
    batch of 8 otherwise kept verifying 4-6 tokens a row, the slope never measured)."""
    clock = FakeClock()
    policy = Auto(clock=clock)
    policy.start(8)
    chosen = []
    for n in range(3):
        k, use, longest = policy.choose([12] * 8, forwards_without_model=1)
        policy.drafted(5.0 if n == 0 else 1.0, max(k, 1), averaged=n > 0)
        width = 1 + max([longest] * any(use) + [k])
        clock.now += 10.0 * width + (5.0 if n == 0 else 1.0)
        policy.observe([longest if u else k for u in use], [0] * 8)
        chosen.append((k, any(use), width))
    assert chosen[0] == (policy.initial, True, 1 + policy.initial)
    assert chosen[1] == (1, False, 2)
    assert policy.draft_cost() == pytest.approx(1.0)


def test_sampling_takes_the_cost_from_the_model_sizes_not_the_clock():
    """Sampling, the lengths decide how the random stream is split into rounds: the choices
    must not depend on timing (the clock, the drafter's reports), so that a seed reproduces
    the output."""
    target, draft = torch.nn.Linear(100, 100), torch.nn.Linear(30, 30)
    ratio = 930 / 10100

    def lengths(clock, report):
        policy = Auto(clock=clock)
        policy.bind(target, draft)
        policy.start(2, greedy=False)
        chosen = []
        for accepted in [3, 0, 5, 2, 7, 1, 4, 4]:
            k, use, longest = policy.choose([5, 0] if accepted % 2 else [0, 0])
            policy.drafted(report(), max(k, 1))
            chosen.append((k, use, longest))
            policy.observe([longest if use[0] else k, k], [min(accepted, k), min(accepted, k)])
        assert policy.draft_cost() == ratio and policy.verify_cost(7) == 1.0
        return chosen

    ticks = iter(range(1000))
    steady = lengths(lambda: next(ticks) * 0.01, lambda: 0.5)
    erratic = lengths(lambda: time.perf_counter() * 1e3, lambda: random.random())
    assert steady == erratic
    assert any(k > 0 for k, _, _ in steady) and any(use[0] for _, use, _ in steady)


def test_auto_in_the_loop_drafts_the_text_where_it_repeats_and_stays_exact():
    """The default beside a draft model: on a prompt that repeats itself the text drafts
    rounds (``stats.matched``); Auto(text=False) never does; both equal the target's greedy
    output, alone and in a ragged batch."""
    from helpers import hf_greedy
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
    target committed: Auto is told, per round with an offer, how many of its drafts could be
    compared and how many equalled the committed tokens, as the plain matcher over the
    committed text says (so a text that lost early is still measured)."""
    from spec_ext.policies.ngram import reference_occurrences

    class ModelOnly(Auto):
        def choose(self, lengths, forwards_without_model=0):
            return 3, [False] * len(lengths), 0

        def observe_text(self, num_draft, num_accepted):
            seen.append((list(num_draft), list(num_accepted)))
            super().observe_text(num_draft, num_accepted)

    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.005, seed=1)  # accepted about half the time: rounds commit 1-4 tokens
    for prompt in ([5, 17, 33, 8, 40, 2] * 4, [7, 8, 9, 7, 8, 3, 7]):
        seen, policy = [], ModelOnly()
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=60, eos_token_id=[], policy=policy)
        seq, pos, expected = out.sequences[0].tolist(), len(prompt), []
        for a in out.stats.accepted_lengths[:-1]:  # the last round may be cut at max_new_tokens
            history, committed = seq[:pos], seq[pos:pos + a + 1]
            _, starts = reference_occurrences(history, 2, 1)
            chain = history[starts[0]:starts[0] + policy.max_draft] if starts else []
            if chain:
                n = min(len(chain), len(committed))
                expected.append(([n], [next((j for j in range(n) if chain[j] != committed[j]), n)]))
            pos += a + 1
        assert seen[:len(expected)] == expected
        assert any(a == n > 1 for (n,), (a,) in expected) and any(a < n for (n,), (a,) in expected)
        assert policy.survival("text")[0] != pytest.approx(policy.prior_acceptance)


def test_auto_prices_a_draft_forward_without_the_draft_models_prefill():
    """The round in which the draft model first runs also reads the whole prompt into its
    cache: its seconds leave the round's time but do not enter one forward's cost (D), which
    the prefill of a long prompt inflated for the rest of the call. Every later report of
    draft forwards is averaged into D (but the first after plain steps, a catch-up over them,
    which a loaded machine's timings may choose), and D is their forgetting average exactly."""
    class Recording(Auto):
        def choose(self, text_lengths, forwards_without_model=0):
            k, use, cap = super().choose(text_lengths, forwards_without_model)
            plain[0] = plain[0] or (k == 0 and not any(use))
            return k, use, cap

        def drafted(self, seconds, forwards, averaged=True):
            reports.append((seconds, forwards, averaged, not reports or plain[0]))
            plain[0] = False
            super().drafted(seconds, forwards, averaged)

    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    draft = perturbed(target, 0.05, seed=1)
    for prompts in ([list(range(3, 90))], [list(range(3, 60)), [7, 8, 9]]):
        reports, plain = [], [False]
        policy = Recording()
        out = spec_ext.generate(target, draft, prompts, max_new_tokens=24, eos_token_id=[], policy=policy)
        assert out.stats.rounds > 3 and len(reports) >= 3 and reports[0][3]
        assert [averaged for _, _, averaged, catch_up in reports] == [not catch_up for *_, catch_up in reports]
        seconds = forwards = 0.0
        for s, f, averaged, _ in reports:
            if not averaged:
                continue
            seconds, forwards = policy.forget_cost * seconds + s, policy.forget_cost * forwards + f
        assert policy.draft_cost() == pytest.approx(seconds / forwards, rel=1e-12)


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


def test_auto_drafts_the_text_beside_a_feature_head_greedy_and_sampling():
    """Beside a feature head (which waits out the rounds the text drafts alone) the text
    drafts its rows too: greedy equals the target on ragged rows with text rounds and head
    rounds, and the first 3 sampled tokens' joint law is the target's (rows of text and of
    the head mixed)."""
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
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    head = echo_head(target, draft_vocab=5, noise=0.05, seed=4)
    out = spec_ext.generate(target, head, [PROMPT] * 20_000, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                            policy=Auto(), seed=7)
    assert 0 < out.stats.text_accepted < out.stats.accepted < out.stats.drafted, out.stats
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(1.0)))
