"""Suffix decoding (SuffixCache, the Suffix policy): the automata's trees against a plain scan
of the stored texts, eviction within the budget, and generate end to end on tiny random
models (fp32, CPU) across calls that share a cache: greedy equals target.generate, sampling
follows the target's exact distribution with a cache primed by earlier calls, two threads."""
import copy
import random
import threading

import numpy as np
import pytest
import torch

import spec_ext
from spec_ext.drafters import Sampler
from spec_ext.policies import Auto, Suffix, SuffixCache, reference_tree
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
    tokens, parents, n, score = cache.propose(cache.match([0, 3, 4]), depth=8, nodes=32)
    # alpha * 2 = 2 nodes: 7 (prob 1), 8 (3/4)
    assert (tokens, parents, n, score) == ([-1, 7, 8], [-1, 0, 1], 2, pytest.approx(1.75))
    tokens, parents, n, score = cache.propose(cache.match([1, 2, 3, 4]), depth=8, nodes=32)
    assert (tokens, parents, n) == ([-1, 7, 8, 9, 5], [-1, 0, 1, 2, 1], 4) and score == pytest.approx(1 + .75 * 2 + .25)
    tokens, _, _, low = cache.propose(cache.match([1, 2, 3, 4]), depth=8, nodes=32, min_prob=0.5)
    assert tokens == [-1, 7, 8, 9] and low == pytest.approx(2.5)  # the 1-in-4 branch is below min_prob
    assert cache.propose(cache.match([1, 2, 3, 4]), depth=2, nodes=3)[:2] == ([-1, 7, 8], [-1, 0, 1])
    assert cache.propose(cache.match([1, 2, 3, 4, 7, 5, 6]), 8, 32)[:3] == ([-1], [-1], 0)  # only at a text's end
    assert cache.propose(cache.match([42]), 8, 32) == ([-1], [-1], 0, 0.0)


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
    policy = Suffix(cache, k=3, max_nodes=6, draft_k=2, round_tokens=6 * n, min_score=1.0 if with_draft else None)
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


def test_the_command_line_runs_several_prompts_only_with_a_cache(tmp_path):
    import subprocess
    import sys
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "spec_ext", "generate", "--target", str(tmp_path), "--prompt", "x",
                          "--prompt", "y", "--policy", "suffix"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().endswith(
        "--prompt: given more than once; only with --suffix-cache (the prompts run in order)"), out.stderr


# ------------------------------------------------------------------------ beside a feature head
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


@pytest.mark.parametrize("min_score,model_memory,primed_at", [(1.0, 0.8, 1.0), (None, 0.0, 0.0), (None, 0.0, 1.0)],
                         ids=["fixed rule", "measured rule", "measured rule, the default's rounds"])
def test_beside_a_head_sampling_follows_the_target_distribution(min_score, model_memory, primed_at):
    """The fixed rule (score >= 1); the measured one with no memory (a row whose head round was
    cut drafts its text next round: rows of both kinds in one verification), the cache holding
    the greedy continuation, so that its trees are expected to beat the head's chain; and the
    cache holding sampled continuations, whose trees are not (every round the default's:
    Auto's own-text chains beside the head's, Suffix.as_auto)."""
    from test_heads import echo_head
    target = llama(VOCAB, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", noise=0.01)
    cache = SuffixCache(prompts=True)
    spec_ext.generate(target, None, [REPEATING] * 64, max_new_tokens=3, temperature=primed_at, eos_token_id=[],
                      suffix_cache=cache, seed=5)
    n = 12_000
    policy = Suffix(cache, k=3, max_nodes=6, draft_k=2, round_tokens=6 * n, min_score=min_score,
                    model_memory=model_memory)
    out = spec_ext.generate(target, head, [REPEATING] * n, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                            policy=policy, seed=6)
    samples = out.sequences[:, len(REPEATING):].numpy()
    assert_follows(samples, exact_joint(target, Sampler(1.0), prompt=REPEATING))
    stats = out.stats
    if min_score is None and primed_at > 0:
        assert stats.cache_matched == 0 and stats.text_accepted > 0 and stats.accepted > stats.text_accepted, stats
        return
    assert stats.cache_matched > 0 and stats.cache_accepted > 0 and stats.draft_calls > 0, stats
    assert stats.accepted > stats.cache_accepted


# ------------------------------------------------------------------------ text or model: the measured rule
def on_a_modeled_clock(cost=lambda width: 1.0 + 0.1 * width, **auto) -> Auto:
    """An Auto whose rounds take ``cost(their width)`` plus their head forwards, each reported at
    ``FORWARD`` seconds whatever it really took, so that its lengths follow the model, not the
    machine's timing."""
    now = [0.0]

    def clock():
        if chain._width is not None:
            now[0] += cost(chain._width) + chain._round_draft
        return now[0]
    chain = Auto(max_draft=12, clock=clock, **auto)
    real = chain.drafted
    chain.drafted = lambda seconds, forwards, averaged=True: real(FORWARD * forwards, forwards, averaged)
    return chain


FORWARD = 0.05  # a head forward's modeled seconds


def modeled(policy: Suffix, text: bool = False, cost=lambda width: 1.0 + 0.1 * width) -> Suffix:
    """``policy`` with its head chain's Auto on a modeled clock (:func:`on_a_modeled_clock`);
    ``text``: the chain's own text beside it."""
    policy.model_chain = on_a_modeled_clock(cost, text=text)
    return policy


def _beside(cache, rows, draft_cost=0.0, draft_k=3, **suffix):
    """A Suffix policy as beside a model (bound with a draft), its TextDrafter started on ``rows``."""
    from spec_ext.drafters import TextDrafter
    target = llama(97, 16, 1, seed=0)
    policy = Suffix(cache, draft_k=draft_k, draft_cost=draft_cost, **suffix)
    policy.bind(target, target)
    policy.start(batch_size=len(rows))
    drafter = TextDrafter(policy)
    drafter.start([list(r) for r in rows], capacity=256, sampler=Sampler())
    return policy, drafter


STORED = list(range(1, 41))  # one earlier request: 40 distinct tokens
WEAK = [60, 61, 62, 5, 6]  # a 2-token match: the cache's tree is [7, 8], scoring 2 (each seen once)
STRONG = [50] + list(range(1, 21))  # a 20-token match: a chain of the 20 tokens after it


def test_a_weak_match_drafts_the_models_chain_and_a_strong_one_the_text():
    """Beside a model, the cache's tree of a short match seen once scores its size (2: the old
    fixed rule, score >= 2, drafted it) but is expected to get 2 x 0.25 accepted: below the
    model's 2 per round, so that row is the model's; the long match's chain is the text's."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    assert cache.propose(cache.match(list(WEAK)), 31, 32)[2:] == (2, 2.0)
    policy, drafter = _beside(cache, [WEAK, STRONG])
    trees = drafter.trees()
    assert trees[0] == ([-1], [-1]) and drafter.from_cache == [False, True]
    # as deep as the round's 16 nodes at batch 2 allow (the own text's budget), past the own text's k = 10
    assert trees[1] == ([-1] + list(range(21, 36)), [-1] + list(range(15)))
    assert policy.expected(0, True, 2, 2.0) == pytest.approx(0.5) and policy.model_mean(0) == 2.0
    # one row going: its cache tree gets cache_nodes (64 by default; 18 is raised to the own text's 32), the paper's rule
    # bounding it by the match's 20 tokens; never fewer than the own text's 32
    for cache_nodes, most in ((64, 20), (18, 20), (40, 20)):
        _, drafter = _beside(cache, [STRONG], cache_nodes=cache_nodes)
        assert drafter.trees()[0] == ([-1] + list(range(21, 21 + most)), [-1] + list(range(most)))
    cache.add([], list(range(1, 41)) + list(range(41, 90)))
    longer = [50] + list(range(1, 41))  # a 40-token match of the longer text: 49 tokens follow it
    for cache_nodes, most in ((64, 40), (40, 39), (8, 31)):
        _, drafter = _beside(cache, [longer], cache_nodes=cache_nodes)
        assert drafter.trees()[0] == ([-1] + list(range(41, 41 + most)), [-1] + list(range(most)))


def test_the_text_is_drafted_where_the_model_would_cost_more_than_it_brings():
    """Batch 1, the weak match alone: a model forward as costly as a verification (draft_cost 1,
    3 drafts) makes the model's 3 tokens cost 4 verifications: the text's 1.5 in one wins."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    assert _beside(cache, [WEAK], draft_cost=0.0)[1].trees() == [([-1], [-1])]
    assert _beside(cache, [WEAK], draft_cost=1.0)[1].trees() == [([-1, 7, 8], [-1, 0, 1])]


def test_the_rule_follows_what_is_accepted():
    """The model's running mean per row and the cache's accepted share per kind of match move
    with the rounds observed: a model that stops being accepted loses the weak row to the text;
    a long match whose drafts keep failing loses its row to a model that is accepted."""
    cache = SuffixCache(prompts=False)
    cache.add([], STORED)
    policy, drafter = _beside(cache, [WEAK, STRONG])
    for _ in range(7):  # row 0 the model's, none accepted; row 1 the text's, all 15 accepted
        assert drafter.trees()[0] == ([-1], [-1])
        policy.observe([3, 15], [0, 15])
    assert policy.model_mean(0) == pytest.approx(2.0 * 0.8 ** 7) and policy.model_mean(0) < 0.5
    assert drafter.trees()[0] == ([-1, 7, 8], [-1, 0, 1]) and drafter.from_cache == [True, True]
    policy.observe([2, 15], [2, 15])
    share = cache.expected(("cache", 16), 1.0)
    assert share > 0.9
    for _ in range(40):  # now the text's drafts all fail, the model's (3) are all accepted
        drafter.trees()
        text = list(drafter.from_cache)
        policy.observe([15 if t else 3 for t in text], [0 if t else 3 for t in text])
    assert cache.expected(("cache", 16), 1.0) < 0.2 * share  # the share fell until the model took the row
    assert cache.expected(("cache", 16), 15.0) < policy.model_mean(1)
    assert drafter.trees()[1] == ([-1], [-1]) and drafter.from_cache == [False, False]
    with pytest.raises(ValueError, match="draft_cost: need a number >= 0"):
        Suffix(draft_cost=-1.0)
    with pytest.raises(ValueError, match="max_depth: need an int >= 1"):
        Suffix(max_depth=0)
    with pytest.raises(ValueError, match="cache_nodes: need an int >= 2"):
        Suffix(cache_nodes=1)


def test_beside_a_head_never_more_target_calls_than_the_head_alone_where_the_cache_matches_weakly():
    """A cache of other requests (random prompts over 12 tokens: their texts share short runs
    with the new requests, seen once or twice): beside a head that the target accepts, no
    request takes more target forwards than the head alone (the old fixed rule: one took 41,
    every round a weak cache tree, against the head's 12), outputs equal. The rule's acceptance
    side, in forwards: the round's width unpriced (``price_width=False``; pricing trades forwards
    for seconds, tested on a modeled clock below). The head's chain on a modeled clock (its
    lengths the same in both); its own text off (the rule's rounds only: none is the default's)."""
    from test_heads import V, echo_head
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.01)
    rng = random.Random(0)
    cache_rounds = 0
    for trial in range(4):
        primers = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
        later = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
        cache = SuffixCache()
        for p in primers:
            spec_ext.generate(target, None, [p], max_new_tokens=40, eos_token_id=[], suffix_cache=cache)
        for p in later:
            alone = spec_ext.generate(target, head, [p], max_new_tokens=40, eos_token_id=[], policy=modeled(
                Suffix(SuffixCache(), own_text=False, draft_k=3, price_width=False)))
            beside = spec_ext.generate(target, head, [p], max_new_tokens=40, eos_token_id=[], policy=modeled(
                Suffix(cache, draft_k=3, price_width=False)))
            assert torch.equal(alone.sequences, beside.sequences)
            assert beside.stats.target_calls <= alone.stats.target_calls, (trial, p)
            cache_rounds += beside.stats.cache_matched
    assert cache_rounds > 20  # the cache drafted where it was expected to win


def test_a_round_the_head_skips_leaves_no_choice_for_the_next_round():
    """A default round (Suffix.as_auto) where only the text drafts skips the head, whose
    propose used to consume Auto's choice of the round: the next cache round must start from
    a fresh plan (its clock ticked), not the skipped round's stale k = 0 (which gave the head
    rows no chain and two rounds' time at one width). Outputs the target's."""
    from test_heads import PROMPTS as HEAD_PROMPTS, V, echo_head
    target = llama(V, 32, 4, seed=2, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10)
    switches = 0
    for prompt in HEAD_PROMPTS:
        full = hf_greedy(target, prompt, 60, None)
        for offset in (10, 20, 30):
            cache = SuffixCache()
            cache.add([], full[offset:offset + 30])
            policy = modeled(Suffix(cache), text=True)
            kinds, begin, as_auto = [], policy.begin_round, policy.as_auto

            def begun(begin=begin, policy=policy, kinds=kinds):
                assert policy.model_chain._choice is None, kinds  # nothing left over from a skipped round
                kinds.append("cache")
                begin()

            policy.begin_round = begun
            policy.as_auto = lambda as_auto=as_auto, kinds=kinds: (kinds.append("default"), as_auto())
            out = spec_ext.generate(target, head, [prompt], max_new_tokens=60, eos_token_id=[], policy=policy)
            assert out.sequences[0, len(prompt):].tolist() == full
            switches += sum(a == "default" and b == "cache" for a, b in zip(kinds, kinds[1:]))
    assert switches >= 3


def test_beside_a_head_where_the_cache_has_nothing_to_add_the_rounds_are_the_defaults():
    """An empty cache: Suffix beside a head drafts exactly as Auto beside the head (per row its own
    text's chain or the head's, Suffix.as_auto), both on one modeled clock: the same outputs
    (= the target's, ragged, EOS), rounds and text rounds. The same requests again, the cache
    holding them: its rounds draft the cache's trees, in fewer target forwards than Auto's."""
    from test_heads import PROMPTS as HEAD_PROMPTS, V, echo_head
    target = llama(V, 32, 4, seed=2, sharpen=3.0)  # (a target whose loops the head drafts as well as the text)
    head = echo_head(target, "eagle3", draft_vocab=10)
    cache = SuffixCache()
    alone = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, on_a_modeled_clock(), max_new=40)
    beside = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, modeled(Suffix(cache), text=True), max_new=40)
    assert torch.equal(alone.sequences, beside.sequences)
    for name in ("target_calls", "rounds", "drafted", "accepted", "matched", "text_drafted", "text_accepted"):
        assert getattr(alone.stats, name) == getattr(beside.stats, name), name
    assert beside.stats.text_accepted > 0 and beside.stats.accepted > beside.stats.text_accepted  # both kinds
    assert beside.stats.cache_matched == 0 and cache.tokens > 0  # the call's rows went into the cache
    again = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, modeled(Suffix(cache), text=True), max_new=40)
    alone = ragged_greedy_equals_target(target, head, HEAD_PROMPTS, on_a_modeled_clock(), max_new=40)
    assert again.stats.cache_accepted > 0 and again.stats.target_calls < alone.stats.target_calls, (
        again.stats, alone.stats)


def test_beside_a_head_every_drafter_follows_the_committed_text_through_both_kinds_of_round():
    """Rounds of both kinds in one call (ragged rows; the cache holds one row's prompt and the
    first 8 tokens of its continuation, a loop of 4 tokens it keeps to its 22nd token: the rule's
    rounds while it matches, the default's after): before every round
    both text drafters' indices hold exactly the committed text, and in the default's rounds the
    head's chain on each head row equals a fresh head's first proposal on the committed text
    (a head fed the wrong features, or a text index that missed a round, drafts worse while the
    output stays exact)."""
    from test_draft_fidelity import first_proposal, rows_of
    from test_heads import V, echo_head
    from spec_ext.drafters import HeadDrafter, build
    from spec_ext.policies import Fixed
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.05)
    prompts = [[9, 4, 10], [3, 1, 2, 3, 4, 5, 6, 7, 8]]
    cache = SuffixCache()
    cache.add(prompts[0], hf_greedy(target, prompts[0], 8, None))
    policy = modeled(Suffix(cache), text=True)
    drafter = build(head, policy)
    propose, kinds, checked = drafter.propose, [], []

    def recording(seqs, roots):
        assert [i.tokens for i in drafter.text.rows] == [list(s) for s in seqs]
        assert [i.tokens for i in drafter.default.text.rows] == [list(s) for s in seqs]
        proposal = propose(seqs, roots)
        kinds.append(policy._as_auto)
        if policy._as_auto and not proposal.is_tree:
            for b, (row, text) in enumerate(zip(rows_of(proposal), proposal.from_text)):
                if not text and row:
                    fresh = rows_of(first_proposal(target, HeadDrafter(head, Fixed(len(row))), [seqs[b]]))[0]
                    assert row == fresh, (len(kinds), b, row, fresh)
                    checked.append(b)
        return proposal

    drafter.propose = recording
    out = spec_ext.generate(target, drafter, prompts, max_new_tokens=40, eos_token_id=[])
    for b, p in enumerate(prompts):
        assert out.sequences[b, -40:].tolist() == hf_greedy(target, p, 40, None)
    assert any(kinds) and not all(kinds) and checked, kinds
    assert out.stats.cache_accepted > 0


def test_greedy_beside_a_head_a_weak_match_is_verified_beside_the_heads_chain():
    """Greedy: a row the rule gives to the head also verifies its offered (weak) text tree as a
    second branch of the same tree; outputs equal the head alone's (= the target's greedy), and
    against the head's chain alone (branch_nodes=0, the behaviour before) no request takes more
    target forwards and some take fewer (the branch whole: ``price_width=False``). The head's
    chain on a modeled clock, without its own text (the rule's rounds only: none is the default's)."""
    from test_heads import V, echo_head
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.01)
    rng = random.Random(0)
    old_total = new_total = 0
    for trial in range(2):
        primers = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
        later = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(3)]

        def primed():
            cache = SuffixCache()
            for p in primers:
                spec_ext.generate(target, None, [p], max_new_tokens=40, eos_token_id=[], suffix_cache=cache)
            return cache
        for p in later:
            expected = hf_greedy(target, p, 40, None)
            old = spec_ext.generate(target, head, [p], max_new_tokens=40, eos_token_id=[], policy=modeled(
                Suffix(primed(), draft_k=3, branch_nodes=0, price_width=False)))
            new = spec_ext.generate(target, head, [p], max_new_tokens=40, eos_token_id=[], policy=modeled(
                Suffix(primed(), draft_k=3, price_width=False)))
            assert torch.equal(new.sequences, old.sequences) and new.sequences[0, len(p):].tolist() == expected, (trial, p)
            assert new.stats.target_calls <= old.stats.target_calls, (trial, p)
            old_total, new_total = old_total + old.stats.target_calls, new_total + new.stats.target_calls
    assert new_total < old_total, (new_total, old_total)
    with pytest.raises(ValueError, match="branch_nodes: need an int >= 0"):
        Suffix(branch_nodes=-1)



@pytest.mark.parametrize("draft_seconds, accepted_share, expected_k", [(10.0, 0.5, 1), (0.0, 1.0, 12)])
def test_beside_a_head_the_chain_length_is_the_one_auto_chooses_from_the_measured_costs(
        draft_seconds, accepted_share, expected_k):
    """The head's chain is as long as Auto's cost model makes it (not a fixed draft_k = 5), on a
    fake clock (each round: a 1 s verification plus its head forwards): forwards 10x a
    verification and half the drafts accepted give chains of 1; free forwards, all accepted,
    Auto's longest (12). The model's drafts are priced at their measured cost."""
    from spec_ext.policies import Auto
    now = [0.0]
    policy = Suffix(SuffixCache(), draft_k=5)
    policy.model_chain = Auto(max_draft=12, text=False, clock=lambda: now[0])
    policy.beside_model = True
    policy.start(1)
    chosen = []
    for _ in range(40):
        policy.text_rows([None])
        policy.proposed([0])
        k = policy.plan()[0]
        chosen.append(k)
        policy.drafted(draft_seconds * k, k)
        now[0] += 1.0 + draft_seconds * k
        policy.observe([k], [int(accepted_share * k)])
    settled = chosen[20:]
    assert max(set(settled), key=settled.count) == expected_k
    assert policy.model_round_cost() == pytest.approx(policy._chain_k * draft_seconds / 1.0)


# ------------------------------------------------------------------------ the round's width, priced
def _clocked_beside(cost, forward=0.1, head_accepted=0, rounds=(2, 4, 8, 16, 32) * 2):
    """A Suffix policy as beside a head (greedy), its head chain's Auto on a fake clock: rounds
    verified at ``rounds`` widths, each taking ``cost(width)`` + the head's forwards x
    ``forward`` seconds; the head's drafts accepted ``head_accepted`` at most per round."""
    from spec_ext.policies import Auto
    now = [0.0]
    policy = Suffix(SuffixCache(), draft_k=3)
    policy.model_chain = Auto(max_draft=12, text=False, clock=lambda: now[0])
    policy.beside_model = True
    policy.start(1)
    for width in rounds:
        policy.begin_round()
        policy.text_rows([None])
        policy.proposed([0])
        k = policy.plan()[0]
        policy.drafted(forward * k, k)
        policy.verifies(width)
        now[0] += cost(width) + forward * k
        policy.observe([k], [min(k, head_accepted)])
    policy.begin_round()  # clocks the last round
    return policy


# a wide, weakly supported cache tree: 8 continuations seen once each after a 40-token match, 31
# nodes of probability 1/8 (4 deep); scored 3.9, expected 0.9 x 3.9 = 3.5 accepted (the 32+ prior)
WIDE = ([1 / 8] * 31, [1 + i // 8 for i in range(31)])


def test_the_text_tree_is_cut_to_the_width_that_pays():
    """Priced with the timed cost by width: where a verification's width is dear (1 s + 0.25 s
    per token, a head forward 0.1 s), the wide weak tree (expected 3.5 accepted over 32 tokens)
    is cut to its best node or two; where every width costs the same it is verified whole, as
    the rule before did (it counted every round as one verification whatever its width). The
    head, never accepted here, does not take the row in either case."""
    offer = (True, 40, sum(WIDE[0]))
    for cost, most, least in ((lambda w: 1.0 + 0.25 * w, 2, 1), (lambda w: 1.0, 31, 31)):
        policy = _clocked_beside(cost, rounds=(2, 4, 8, 16, 32) * 4)
        assert policy.pricing and policy.model_mean(0) < 0.05
        assert policy.text_rows([offer]) == [True]  # the rule's choice: the text, whole
        keep, side = policy.priced([WIDE[0]], [WIDE[1]])
        assert least <= keep[0] <= most and side == [0], (keep, side)
    # the same cut on the drafter's trees: the best nodes, parents kept
    from spec_ext.policies.suffix import best_nodes
    assert best_nodes(([-1, 5, 6, 7, 8], [-1, 0, 1, 0, 3]), [0.5, 0.5, 0.4, 0.4], 3) == ([-1, 5, 6, 7],
                                                                                       [-1, 0, 1, 0])


def test_a_head_row_verifies_the_text_branch_only_where_its_width_pays():
    """A head accepted 2 per round and a weak own-text chain of 10 (each node 1/2: expected
    0.5 x 5 = 2.5, so the rule before drafted it alone, 11 wide): priced where width is free,
    the row takes the head's chain with the whole chain of text beside it (``branch_nodes``,
    10: the branch past the head's depth adds what the text gets there); where it is dear
    (0.25 s per token against a 1 s verification), the head's chain alone."""
    probs, depths = [0.5] * 10, list(range(1, 11))
    sides = []
    for cost in (lambda w: 1.0, lambda w: 1.0 + 0.25 * w):
        policy = _clocked_beside(cost, forward=0.01, head_accepted=2)
        assert policy.text_rows([(False, 2, sum(probs))]) == [True]
        keep, side = policy.priced([probs], [depths])
        assert keep == [0]
        sides.append(side[0])
    assert sides == [10, 0], sides


def test_width_costs_read_the_timed_widths():
    """``width_costs`` is Auto's table by width, read once per round: measured widths shrunk
    toward the line through all of them, the others on the line (never cheaper when wider); the
    line's slope is shrunk toward 5% of the mean per token until the widths measured spread, so
    that a few narrow, noisy widths do not price a wide one at several times its cost."""
    from spec_ext.policies.suffix import width_costs
    policy = _clocked_beside(lambda w: 1.0 + 0.25 * w)
    table = width_costs(policy.model_chain.timed_widths(), 40)
    for w in (2, 3, 4, 8, 16, 32, 40):  # spread widths measured: the line they lie on (the slope's prior aside)
        assert table[w] == pytest.approx(1.0 + 0.25 * w, rel=0.06), (w, table[w])
    assert all(a <= b + 1e-12 for a, b in zip(table[1:], table[2:]))
    assert width_costs({}, 3) == [0.0] * 4
    # two narrow widths measured 3 times, one on a stall (2 tokens: 1.0 s, 3 tokens: 2.0 s): the line
    # through them alone prices 32 tokens at 31 s; shrunk toward 5% of the mean per token, under 5 s
    narrow = width_costs({2: [3.0, 3.0], 3: [3.0, 6.0]}, 32)
    assert narrow[32] < 5.0 and narrow[3] > narrow[2]


def test_beside_a_head_on_a_modeled_clock_the_width_is_priced_and_greedy_equals_target():
    """End to end, the head's Auto on a modeled clock (a round: 1 + 0.3 per verified token, or
    1 whatever its width; head forwards at 0.1 of a 1-token verification): with the cache
    matching weakly and the rows' own texts looping, outputs equal HF's greedy either way; dear
    width verifies narrower rounds than free width, and on the dear clock the priced rounds
    take no more modeled time than the rule before (``price_width=False``) in total."""
    from spec_ext.policies import Auto
    from test_heads import V, echo_head
    target = llama(V, 32, 4, seed=3, sharpen=3.0)
    head = echo_head(target, "eagle3", draft_vocab=10, noise=0.01)
    rng = random.Random(0)
    primers = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
    later = [[rng.randrange(1, V) for _ in range(rng.randrange(3, 9))] for _ in range(3)]

    def run(prompt, cost, price_width):
        cache = SuffixCache()
        for p in primers:
            spec_ext.generate(target, None, [p], max_new_tokens=40, eos_token_id=[], suffix_cache=cache)
        # the chain without its own text: every round is the Suffix rule's, none the default's
        policy = modeled(Suffix(cache, draft_k=3, draft_cost=0.1, price_width=price_width), cost=cost)
        widths = []
        verifies, drafted, forwards = policy.verifies, policy.drafted, []

        def verified(width, *args):
            widths.append(width)
            verifies(width, *args)

        def timed(seconds, count, averaged=True):
            forwards.append(count)
            drafted(seconds, count, averaged)
        policy.verifies, policy.drafted = verified, timed
        out = spec_ext.generate(target, head, [prompt], max_new_tokens=40, eos_token_id=[], policy=policy)
        assert out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 40, None)
        return widths, sum(map(cost, widths)) + 0.1 * cost(1) * sum(forwards)

    def dear(w):
        return 1.0 + 0.3 * w

    narrow = wide = priced = unpriced = 0.0
    for prompt in later:
        dear_widths, dear_seconds = run(prompt, dear, True)
        free_widths, _ = run(prompt, lambda w: 1.0, True)
        narrow, wide = narrow + sum(dear_widths) / len(dear_widths), wide + sum(free_widths) / len(free_widths)
        old_widths, old_seconds = run(prompt, dear, False)  # its widths: as the drafter built them
        priced += dear_seconds
        unpriced += old_seconds
    assert narrow < wide, (narrow, wide)
    assert priced <= unpriced, (priced, unpriced)
