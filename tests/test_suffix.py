"""Suffix decoding (SuffixCache, the Suffix policy): the automata's trees against a plain scan
of the stored texts, eviction within the budget, and generate end to end on tiny random
models (fp32, CPU) across calls that share a cache: greedy equals target.generate, sampling
follows the target's exact distribution with a cache primed by earlier calls, two threads."""
import copy
import dataclasses
import random
import threading

import numpy as np
import pytest
import torch

import spec_ext
from spec_ext.drafters import Sampler, TextSource
from spec_ext.policies import Auto, Call, Costs, Pricing, Report, RoundState, Source, Suffix, SuffixCache
from spec_ext.reference import reference_tree
from helpers import VOCAB, assert_follows, exact_joint, hf_greedy, llama, perturbed, ragged_greedy_equals_target


# ------------------------------------------------------------------------ the cache
def test_the_cache_proposes_what_a_plain_scan_of_the_stored_texts_finds():
    """Random repetitive texts over small vocabularies, evicting caches of 1 to 4 segments,
    histories that grow between lookups (and requests added between them): every lookup's
    tree, match length and score equal :func:`reference_tree` over ``cache.texts()``."""
    rng = random.Random(0)
    long_matches = branched = 0
    for trial in range(250):
        cache = SuffixCache(budget=rng.choice([40, 100, 10_000]), segments=rng.choice([1, 2, 4]),
                            max_match=rng.choice([2, 5, 64]), prompts=rng.random() < 0.5)
        V = rng.choice([2, 3, 6])
        motif = [rng.randrange(V) for _ in range(8)]
        for _ in range(rng.randrange(1, 8)):
            output = [t if rng.random() > 0.2 else rng.randrange(V) for t in motif[:rng.randrange(1, 9)]]
            cache.add([rng.randrange(V) for _ in range(rng.randrange(0, 4))], output + [rng.randrange(V)] * 2)
        history = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        match = cache.match(history)
        for _ in range(4):
            depth, nodes = rng.randrange(1, 6), rng.randrange(2, 20)
            alpha, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3])
            got = cache.propose(match, depth, nodes, alpha, min_prob)
            want = reference_tree(cache.texts(), history, depth, nodes, alpha, min_prob, cache.max_match)
            assert got[:3] == want[:3] and got[3] == pytest.approx(want[3]), (history, cache.texts())
            long_matches += got[2] >= 3
            branched += len(set(got[1])) < len(got[1]) - 1
            history += [rng.randrange(V) for _ in range(rng.randrange(1, 3))]
            if rng.random() < 0.3:  # another call finished meanwhile: the row walks that segment again
                cache.add([], [rng.randrange(V) for _ in range(5)])
    assert long_matches > 100 and branched > 10, (long_matches, branched)


def test_the_tree_is_sized_by_the_match_and_the_counts():
    cache = SuffixCache(prompts=False)
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 9], [7, 5, 6]):
        cache.add([], [1, 2, 3, 4] + tail)
    tokens, parents, n, score, _ = cache.propose(cache.match([0, 3, 4]), depth=8, nodes=32)
    # alpha * 2 = 2 nodes: 7 (prob 1), 8 (3/4)
    assert (tokens, parents, n, score) == ([-1, 7, 8], [-1, 0, 1], 2, pytest.approx(1.75))
    tokens, parents, n, score, _ = cache.propose(cache.match([1, 2, 3, 4]), depth=8, nodes=32)
    assert (tokens, parents, n) == ([-1, 7, 8, 9, 5], [-1, 0, 1, 2, 1], 4) and score == pytest.approx(1 + .75 * 2 + .25)
    tokens, _, _, low, _ = cache.propose(cache.match([1, 2, 3, 4]), depth=8, nodes=32, min_prob=0.5)
    assert tokens == [-1, 7, 8, 9] and low == pytest.approx(2.5)  # the 1-in-4 branch is below min_prob
    assert cache.propose(cache.match([1, 2, 3, 4]), depth=2, nodes=3)[:2] == ([-1, 7, 8], [-1, 0, 1])
    assert cache.propose(cache.match([1, 2, 3, 4, 7, 5, 6]), 8, 32)[:3] == ([-1], [-1], 0)  # only at a text's end
    assert cache.propose(cache.match([42]), 8, 32) == ([-1], [-1], 0, 0.0, [])


def test_eviction_drops_whole_old_requests_and_keeps_the_budget():
    rng = random.Random(1)
    cache = SuffixCache(budget=200, segments=4, prompts=False)
    added = []
    for i in range(120):
        output = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        cache.add([], output)
        added.append(output)
        assert cache.tokens <= 200
        stored = cache.texts()
        assert stored == added[len(added) - len(stored):], "the newest requests, whole, in order"
        assert sum(map(len, stored)) == cache.tokens
        if sum(map(len, added)) >= 200:
            assert cache.tokens >= 200 * 3 // 4 - 30, cache.tokens  # at most one segment short (and a request)
    cache.add([], list(range(201)))  # longer than the budget: not stored
    assert cache.texts() == stored
    with pytest.raises(ValueError, match="budget: must be an int >= 1"):
        SuffixCache(budget=0)
    with pytest.raises(ValueError, match="tree: Suffix drafts trees"):
        Suffix(tree=False)
    with pytest.raises(ValueError, match="cache: expected a SuffixCache"):
        Suffix(cache={})


# ------------------------------------------------------------------------ greedy, end to end
@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5], [40], [9, 9, 9, 9, 9, 12], [70, 71, 60, 70, 71]]
AGAIN = [[5, 17, 33, 8, 5, 17, 33, 8, 5], [41, 40], [3, 9, 9, 9, 9, 9, 12], [70, 71, 60, 70, 71, 88]]


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "beside the draft"])
def test_greedy_equals_target_across_calls_that_share_the_cache(pair, with_draft):
    """Three ragged calls with EOS, the later ones revisiting the earlier prompts (the same, one
    token more before or after): each equals target.generate, and the later ones draft from
    the cache, which ends up holding every finished row."""
    target, draft = pair
    cache = SuffixCache(prompts=True)
    first = ragged_greedy_equals_target(target, draft if with_draft else None, PROMPTS, Suffix(cache))
    assert first.stats.cache_matched == 0 and cache.tokens > 0
    assert (first.stats.draft_calls > 0) == with_draft  # nothing cached yet: the model drafts
    for prompts in (AGAIN, PROMPTS):
        stats = ragged_greedy_equals_target(target, draft if with_draft else None, prompts, Suffix(cache)).stats
        assert stats.cache_matched > 0 and stats.cache_accepted > 0, stats
        assert stats.cache_matched <= stats.matched and stats.cache_accepted <= stats.text_accepted
        assert sum(stats.row_cache_matched) == stats.cache_matched == stats.as_dict()["cache_matched"]
        assert with_draft or stats.draft_calls == 0  # beside a model, a call the cache predicts may not need it
    assert len(cache.texts()) == 3 * len(PROMPTS)


def test_eviction_never_changes_the_outputs(pair):
    target, _ = pair
    small, matched = SuffixCache(budget=100, segments=2), 0
    for prompts in (PROMPTS, AGAIN, PROMPTS, AGAIN):
        matched += ragged_greedy_equals_target(target, None, prompts, Suffix(small)).stats.cache_matched
        assert small.tokens <= 100
    assert matched > 0 and len(small.texts()) < 4 * len(PROMPTS)  # it drafted, and it evicted


def test_generate_and_accelerate_take_a_cache(pair):
    target, _ = pair
    ids = torch.tensor([[5, 17, 33, 8, 5, 17]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    fast = spec_ext.accelerate(target, None, policy="ngram")  # keeps a cache of its own
    for call in range(2):
        assert torch.equal(fast.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0), expected)
        assert (fast.last_stats.cache_matched > 0) == (call == 1), fast.last_stats
    plain = spec_ext.accelerate(target, None, policy="ngram", suffix_cache=False)
    plain.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert plain.last_stats.cache_matched == 0
    cache = SuffixCache()
    for call in range(2):
        out = spec_ext.generate(target, None, ids, max_new_tokens=24, pad_token_id=0, suffix_cache=cache)
        assert torch.equal(out.sequences, expected) and (out.stats.cache_matched > 0) == (call == 1)
    with pytest.raises(ValueError, match="suffix_cache: drafts with policy 'auto', 'ngram' or 'suffix'"):
        spec_ext.generate(target, None, ids, policy="fixed", suffix_cache=cache)
    with pytest.raises(ValueError, match="suffix_cache: expected a spec_ext.SuffixCache"):
        spec_ext.generate(target, None, ids, suffix_cache={})


def test_two_threads_share_a_cache(pair):
    """Two threads, each with its own copy of the target, run three calls at once into one
    cache: every output equals target.generate and the cache holds every row."""
    target, _ = pair
    cache = SuffixCache()
    expected = {tuple(p): hf_greedy(target, p, 20, eos=[]) for p in PROMPTS + AGAIN}
    failures, matched = [], []

    def work(model, order):
        try:
            for prompts in order:
                out = spec_ext.generate(model, None, prompts, max_new_tokens=20, eos_token_id=[], suffix_cache=cache)
                for b, p in enumerate(prompts):
                    assert out.sequences[b, -20:].tolist() == expected[tuple(p)], p
                matched.append(out.stats.cache_matched)
        except Exception as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=(copy.deepcopy(target), order))
               for order in ([PROMPTS, AGAIN, PROMPTS], [AGAIN, PROMPTS, AGAIN])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert len(cache.texts()) == 6 * len(PROMPTS) and sum(matched) > 0


# ------------------------------------------------------------------------ exact distribution
REPEATING = [1, 3, 5, 1, 3, 5, 1, 3]


@pytest.fixture(scope="module")
def sampling_pair():
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    return target, perturbed(target, 0.01, seed=11)


@pytest.mark.parametrize("with_draft,temperature,top_k", [(False, 1.0, None), (True, 0.7, 5)],
                         ids=["alone T=1", "beside the draft T=0.7 top-k"])
def test_sampling_follows_the_target_distribution_with_a_primed_cache(sampling_pair, with_draft, temperature,
                                                                        top_k):
    """A cache primed by an earlier sampled call on the same prompt: its trees branch where
    that call's samples did; the next call's samples follow the exact law."""
    target, draft = sampling_pair
    cache = SuffixCache(prompts=True)
    spec_ext.generate(target, None, [REPEATING] * 64, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                      suffix_cache=cache, seed=3)  # the primer: 64 sampled continuations
    n = 12_000
    policy = Suffix(cache, k=3, max_nodes=6, draft_k=2, round_tokens=6 * n)
    if with_draft:  # every other row the cache's tree (where it has one), the others the model's 2 drafts
        policy = AlternatingCache(cache)
    out = spec_ext.generate(target, draft if with_draft else None, [REPEATING] * n, max_new_tokens=3,
                            temperature=temperature, top_k=top_k, eos_token_id=[], policy=policy,
                            seed=int(100 * temperature) + with_draft)
    samples = out.sequences[:, len(REPEATING):].numpy()
    assert_follows(samples, exact_joint(target, Sampler(temperature, top_k), prompt=REPEATING))
    stats = out.stats
    assert stats.cache_matched > 0 and stats.cache_drafted > stats.cache_matched and stats.cache_accepted > 0, stats
    if with_draft:
        assert stats.draft_calls > 0 and stats.matched < stats.rounds
    assert np.isin(samples, np.arange(VOCAB)).all()


@dataclasses.dataclass(frozen=True)
class AlternatingCache(Suffix):
    """Even rows the cache's tree of up to 6 nodes where it has one, the others the model's 2
    drafts: rows of both kinds in every round, whatever a round's price."""

    def start(self, call):
        from spec_ext.policies import Controller, RoundPlan

        class Alternating(Controller):
            def plan(self, state):
                trees = [state.text.cache_tree(r, 5, 6) if r % 2 == 0 else None for r in range(state.rows)]
                return RoundPlan([0 if t is not None else 2 for t in trees], trees)
        return Alternating(self, call)


def test_the_command_line_runs_several_prompts_only_with_a_cache(tmp_path):
    import subprocess
    import sys
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "spec_ext", "generate", "--target", str(tmp_path), "--prompt", "x",
                          "--prompt", "y", "--policy", "suffix"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().endswith(
        "--prompt: given more than once; only with --suffix-cache (the prompts run in order)"), out.stderr


# ------------------------------------------------------------------------ beside a model
FORWARD = 0.05  # a model forward's modeled seconds


class ModeledPricing(Pricing):
    """Rounds priced by a model, not the machine's timing: a verification of w tokens costs
    ``cost(w)``, each draft step ``forward``."""

    def __init__(self, cost, forward=FORWARD):
        super().__init__(Costs(), True)
        self.cost, self.forward = cost, forward

    def verify(self, rows, width):
        return self.cost(width)

    def draft(self, steps, rows=1):
        return self.forward * steps


def modeled(policy, cost=lambda width: 1.0 + 0.1 * width, forward=FORWARD):
    """``policy`` (Suffix or Auto) whose controllers price rounds by :class:`ModeledPricing`, so
    that its choices follow the model, not the machine's load."""
    @dataclasses.dataclass(frozen=True)
    class Modeled(type(policy)):
        def start(self, call):
            controller = super().start(call)
            controller.pricing = ModeledPricing(cost, forward)
            return controller
    Modeled.__name__ = type(policy).__name__
    return Modeled(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


STORED = list(range(1, 41))  # one earlier request: 40 distinct tokens
WEAK = [60, 61, 62, 5, 6]  # a 2-token match: the cache's tree is [7, 8], each seen once
STRONG = [50] + list(range(1, 21))  # a 20-token match: a chain of the 20 tokens after it


def beside(cache, rows, cost=lambda width: 1.0 + 0.1 * width, forward=FORWARD, **suffix):
    """A Suffix controller as beside a model, and the rows' text (their histories ``rows``),
    its rounds priced by :class:`ModeledPricing`."""
    policy = modeled(Suffix(cache, draft_k=3, **suffix), cost, forward)
    text = TextSource(policy.text_settings(True))
    text.start([list(r) for r in rows])
    model = torch.nn.Linear(4, 4)
    return policy.start(Call(len(rows), True, model, model)), text


def settle(controller, text, rows=8, accepted=lambda source, drafts: 0):
    """A few rounds (the costs' first measuring rounds aside); returns the last plan."""
    for _ in range(rows):
        plan = controller.plan(RoundState(controller.rows, text))
        drafted = [t.drafts if t is not None else k for t, k in zip(plan.text, plan.k)]
        runs = [min(d, accepted(s, d)) for s, d in zip(plan.sources, drafted)]
        controller.observe(Report(plan, plan.sources, drafted, runs, [[0] * (a + 1) for a in runs],
                                  1 + max(drafted), seconds=1.0))
    return controller.plan(RoundState(controller.rows, text))


def test_a_weak_match_drafts_the_models_chain_and_a_strong_one_the_cache():
    """Beside a model, the cache's tree of a short match seen once scores its size (2) but is
    expected to get 2 x 0.25 accepted, below the model's chain: that row is the model's; the
    long match's chain (a share of 0.8 of its 20) is the cache's, cut where its width stops
    paying."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    tree = cache.propose(cache.match(list(WEAK)), 31, 32)
    assert (tree.match, tree.score) == (2, 2.0)
    controller, text = beside(cache, [WEAK, STRONG])
    plan = settle(controller, text, accepted=lambda source, drafts: drafts)
    assert plan.sources == [Source.MODEL, Source.CACHE], plan
    assert plan.text[1].tokens[:4] == (-1, 21, 22, 23) and plan.text[1].parents[:4] == (-1, 0, 1, 2)


def test_a_rows_cache_tree_follows_one_rule_alone_and_beside_a_model():
    """``Suffix.cache_offer``, which a row's cache tree comes from alone and beside a model: at
    most ``cache_nodes`` nodes at one row, the own text's budget with more rows, none deeper
    than ``max_depth``; none where the match is not longer than ``longer_than`` or the tree
    scores under ``min_score``."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    text = TextSource(Suffix(cache).text_settings(True))
    text.start([list(STRONG)])  # its 20 last tokens stored: the cache continues 21, 22, ...
    offer = Suffix(cache, cache_nodes=6).cache_offer(text, 0, 1)
    assert (offer.tokens, offer.parents, offer.match) == ((-1, 21, 22, 23, 24, 25), (-1, 0, 1, 2, 3, 4), 20)
    assert Suffix(cache, cache_nodes=6, max_depth=3).cache_offer(text, 0, 1).tokens == (-1, 21, 22, 23)
    assert Suffix(cache, round_tokens=16).cache_offer(text, 0, 4).tokens == (-1, 21, 22, 23)  # 16 // 4 nodes
    assert Suffix(cache).cache_offer(text, 0, 1, longer_than=20) is None
    assert Suffix(cache).cache_offer(text, 0, 1, longer_than=19) is not None
    assert Suffix(cache, cache_nodes=6, min_score=5.5).cache_offer(text, 0, 1) is None
    assert Suffix(cache, cache_nodes=6, min_score=5.0).cache_offer(text, 0, 1) is not None
    alone = Suffix(cache, cache_nodes=6, own_text=False).start(Call(1))
    assert alone.offers(RoundState(1, text)) == [offer]
    controller, text = beside(cache, [STRONG], cache_nodes=6)
    _, trees = controller._offers(RoundState(1, text))
    assert trees[0][0] == offer


def test_the_cache_is_drafted_where_the_model_would_cost_more_than_it_brings():
    """Batch 1, the weak match alone, each source's first draft accepted: where a model forward
    costs more than a verification the weak tree wins; where it is free and always accepted, the
    model."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    dear, text = beside(cache, [WEAK], forward=1.5)
    assert settle(dear, text, accepted=lambda source, drafts: min(drafts, 1)).sources == [Source.CACHE]
    cheap, text = beside(cache, [WEAK], forward=0.0)
    assert settle(cheap, text, accepted=lambda source, drafts: drafts).sources == [Source.MODEL]


def test_the_choice_follows_what_is_accepted():
    """The cache's accepted share per kind of match moves with the rounds observed: a long match
    whose drafts keep failing loses its row to a model that is accepted."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    controller, text = beside(cache, [STRONG])
    assert settle(controller, text, rows=4, accepted=lambda source, drafts: drafts).sources == [Source.CACHE]
    share = cache.expected(("cache", 16), 1.0)
    plan = settle(controller, text, rows=60,
                  accepted=lambda source, drafts: 0 if source == Source.CACHE else drafts)
    assert cache.expected(("cache", 16), 1.0) < 0.5 * share
    assert plan.sources == [Source.MODEL]
    with pytest.raises(ValueError, match="max_depth: need an int >= 1"):
        Suffix(max_depth=0)
    with pytest.raises(ValueError, match="cache_nodes: need an int >= 2"):
        Suffix(cache_nodes=1)


def test_a_wide_weak_tree_is_cut_to_the_width_that_pays():
    """Eight earlier continuations seen once each after a long match: a wide tree of nodes of
    probability 1/8. Where a verification's width is dear the row verifies its best few nodes;
    where every width costs the same, the whole tree (the model, never accepted, not run)."""
    cache = SuffixCache(prompts=False)
    prefix = list(range(1, 41))
    for branch in range(8):
        cache.add([], prefix + [50 + branch, 60 + branch, 70 + branch, 80 + branch])
    widths = []
    for cost in (lambda w: 1.0 + 0.25 * w, lambda w: 1.0):
        controller, text = beside(cache, [[90] + prefix], cost=cost)
        plan = settle(controller, text)
        assert plan.sources == [Source.CACHE] and not plan.model_runs
        widths.append(plan.text[0].drafts)
    assert widths[0] <= 3 and widths[1] == 32, widths


def test_beside_a_head_greedy_equals_target_and_the_head_drafts_the_other_rows():
    """A sharpened target that loops, an echo head: across calls sharing the cache, rows with a
    cache match draft its trees, the others the head's chains (one forward for both); greedy
    equals target.generate (ragged, EOS)."""
    from test_heads import PROMPTS as HEAD_PROMPTS, V, echo_head
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.01)
    cache = SuffixCache(prompts=True)
    first = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, Suffix(cache, draft_k=3), max_new=24)
    assert first.stats.cache_matched == 0 and first.stats.draft_calls > 0 and first.stats.accepted > 0
    again = ragged_greedy_equals_target(target, head, HEAD_PROMPTS + [[6, 2]], Suffix(cache, draft_k=3), max_new=24)
    stats = again.stats
    assert stats.cache_matched > 0 and stats.cache_accepted > 0 and stats.draft_calls > 0, stats
    assert stats.accepted > stats.cache_accepted  # the head's drafts were accepted too


@pytest.mark.parametrize("min_score,primed_at", [(1.0, 0.0), (None, 0.0), (None, 1.0)],
                         ids=["a least score", "primed greedy", "primed sampled"])
def test_beside_a_head_sampling_follows_the_target_distribution(min_score, primed_at, monkeypatch):
    """The cache holding the greedy continuation (its trees expected to beat the head's chain),
    with and without a least score: rows of both kinds in one verification; and holding
    sampled continuations. The rows' own text is off (at a flat sampled price it would take
    every row from the head on this repeating prompt). The
    verification is priced flat by width and every row at the pool's acceptance (at 12,000
    rows, timed, a wide verification costs so much that a plain step beats every draft, and
    the slowest of 12,000 rows prices the head's drafts at little)."""
    from test_heads import echo_head
    from spec_ext.policies import Costs
    from spec_ext.policies.estimates import RowSpread
    flat = Costs()
    for w in range(1, 40):
        flat.record_verify(256, w, 1.0)
    monkeypatch.setattr("spec_ext.policies.estimates.round_costs", lambda call, schedule, sequential: flat)
    monkeypatch.setattr(RowSpread, "scales", lambda self, chance, seen, passed: [1.0] * len(seen))
    target = llama(VOCAB, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", noise=0.01)
    cache = SuffixCache(prompts=True)
    spec_ext.generate(target, None, [REPEATING] * 64, max_new_tokens=3, temperature=primed_at, eos_token_id=[],
                      suffix_cache=cache, seed=5)
    n = 12_000
    policy = Suffix(cache, k=3, max_nodes=6, draft_k=2, round_tokens=6 * n, min_score=min_score, own_text=False)
    out = spec_ext.generate(target, head, [REPEATING] * n, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                            policy=policy, seed=6)
    samples = out.sequences[:, len(REPEATING):].numpy()
    assert_follows(samples, exact_joint(target, Sampler(1.0), prompt=REPEATING))
    stats = out.stats
    assert stats.cache_matched > 0 and stats.accepted > 0, stats
    if primed_at == 0:  # head rows beside cache rows
        assert stats.accepted > stats.cache_accepted > 0 and stats.draft_calls > 0, stats


def test_beside_a_head_never_more_target_calls_than_the_head_alone_where_the_cache_matches_weakly():
    """A cache of other requests (random prompts over 12 tokens: their texts share short runs
    with the new requests, seen once or twice): beside a head that the target accepts, the
    requests take no more target forwards in all than with the head alone (an empty cache), and
    none more than two extra (an old fixed rule took 41 on one, every round a weak cache tree,
    against the head's 12; two: where the cache drafts the first planned round, the head's
    chains start from one draft and grow one a round); outputs equal. Both priced on one modeled clock with free width
    (the choice is by expected accepted tokens alone)."""
    from test_heads import V, echo_head
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.01)
    rng = random.Random(0)
    cache_rounds = alone_calls = cache_calls = 0
    for trial in range(4):
        primers = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
        later = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
        cache = SuffixCache()
        for p in primers:
            spec_ext.generate(target, None, [p], max_new_tokens=40, eos_token_id=[], suffix_cache=cache)
        for p in later:
            alone = spec_ext.generate(target, head, [p], max_new_tokens=40, eos_token_id=[],
                                      policy=modeled(Suffix(SuffixCache(), own_text=False), cost=lambda w: 1.0))
            with_cache = spec_ext.generate(target, head, [p], max_new_tokens=40, eos_token_id=[],
                                           policy=modeled(Suffix(cache, own_text=False), cost=lambda w: 1.0))
            assert torch.equal(alone.sequences, with_cache.sequences)
            assert with_cache.stats.target_calls <= alone.stats.target_calls + 2, (trial, p)
            cache_rounds += with_cache.stats.cache_matched
            alone_calls, cache_calls = alone_calls + alone.stats.target_calls, cache_calls + with_cache.stats.target_calls
    assert cache_calls <= alone_calls, (cache_calls, alone_calls)
    assert cache_rounds > 10  # the cache drafted where it was expected to win


def test_beside_a_head_where_the_cache_has_nothing_to_add_the_rounds_are_auto_s():
    """An empty cache: Suffix beside a head drafts exactly as Auto beside the head (per row its own
    text's chain or the head's), both on one modeled clock: the same outputs (= the target's,
    ragged, EOS), rounds and text rounds. The same requests again, the cache holding them: its
    rounds draft the cache's trees, in fewer target forwards than Auto's."""
    from test_heads import PROMPTS as HEAD_PROMPTS, V, echo_head
    target = llama(V, 32, 4, seed=2, sharpen=3.0)  # (a target whose loops the head drafts as well as the text)
    head = echo_head(target, "eagle3", draft_vocab=10)
    cache = SuffixCache()
    auto = modeled(Auto())
    alone = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, auto, max_new=40)
    beside_ = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, modeled(Suffix(cache)), max_new=40)
    assert torch.equal(alone.sequences, beside_.sequences)
    for name in ("target_calls", "rounds", "drafted", "accepted", "matched", "text_drafted", "text_accepted"):
        assert getattr(alone.stats, name) == getattr(beside_.stats, name), name
    assert beside_.stats.text_accepted > 0 and beside_.stats.accepted > beside_.stats.text_accepted  # both kinds
    assert beside_.stats.cache_matched == 0 and cache.tokens > 0  # the call's rows went into the cache
    again = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, modeled(Suffix(cache)), max_new=40)
    alone = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, auto, max_new=40)
    assert again.stats.cache_accepted > 0 and again.stats.target_calls < alone.stats.target_calls, (
        again.stats, alone.stats)


def test_beside_a_head_every_drafter_follows_the_committed_text_through_both_kinds_of_round(monkeypatch):
    """Rounds of the cache's, the own text's and the head's in one call (ragged rows; the cache
    holds one row's prompt and the first 8 tokens of its continuation): before every round the
    text's indices hold exactly the committed text, and every head chain equals a fresh head's
    first proposal on the committed text (a head fed the wrong features, or a text index that
    missed a round, drafts worse while the output stays exact)."""
    from test_draft_fidelity import first_proposal, rows_of
    from test_heads import V, echo_head
    from spec_ext.drafters import HeadDrafter, MixedDrafter
    from spec_ext.policies import Fixed
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.05)
    prompts = [[9, 4, 10], [3, 1, 2, 3, 4, 5, 6, 7, 8]]
    cache = SuffixCache()
    cache.add(prompts[0], hf_greedy(target, prompts[0], 8, None))
    policy = modeled(Suffix(cache))
    propose, sources, checked = MixedDrafter.propose, [], []

    def recording(drafter, seqs, roots, plan):
        if drafter.text is None:  # a fresh head's call, below
            return propose(drafter, seqs, roots, plan)
        assert [i.tokens for i in drafter.text.rows] == [list(s) for s in seqs]
        proposal = propose(drafter, seqs, roots, plan)
        sources.extend(proposal.source)
        if not proposal.is_tree:
            for b, (row, source) in enumerate(zip(rows_of(proposal), proposal.source)):
                if source == Source.MODEL and row:
                    fresh = rows_of(first_proposal(target, lambda: HeadDrafter(head), Fixed(len(row)), [seqs[b]]))[0]
                    assert row == fresh, (len(sources), b, row, fresh)
                    checked.append(b)
        return proposal

    monkeypatch.setattr(MixedDrafter, "propose", recording)
    out = spec_ext.generate(target, head, prompts, max_new_tokens=40, eos_token_id=[], policy=policy)
    for b, p in enumerate(prompts):
        assert out.sequences[b, -40:].tolist() == hf_greedy(target, p, 40, None)
    assert Source.CACHE in sources and Source.MODEL in sources and checked, sources
    assert out.stats.cache_accepted > 0
