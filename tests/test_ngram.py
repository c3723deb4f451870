"""Prompt lookup (NGram): the incremental matcher against the plain scan, continuation
trees, and the loop end to end on tiny random models (fp32, CPU): greedy output equals the
target's own, sampled output follows the target's exact distribution, alone and beside a
draft model, chains and trees."""
import random

import numpy as np
import pytest
import torch

import spec_ext
from spec_ext.drafters import ModelDrafter, Sampler, TextDrafter, TextFirst
from spec_ext.policies import NGram, NGramIndex, continuation_tree, reference_occurrences
from helpers import VOCAB, assert_follows, exact_joint, hf_greedy, llama, perturbed, ragged_greedy_equals_target


# ------------------------------------------------------------------------ the matcher
def streams():
    rng = random.Random(0)
    random_stream = [rng.randrange(3) for _ in range(400)]
    motif = [rng.randrange(50) for _ in range(13)]
    repetitive = [t if rng.random() > 0.05 else rng.randrange(50) for t in motif * 30]
    return {"random": random_stream, "repetitive": repetitive, "constant": [7] * 60}


@pytest.mark.parametrize("name", ["random", "repetitive", "constant"])
@pytest.mark.parametrize("n_max,n_min", [(1, 1), (2, 1), (4, 2), (5, 5)])
def test_incremental_index_finds_what_the_plain_scan_finds(name, n_max, n_min):
    stream = streams()[name]
    rng = random.Random(n_max * 10 + n_min)
    index, length, found = NGramIndex(stream[:3], n_max, n_min), 3, 0
    while length < len(stream):
        n, starts = reference_occurrences(stream[:length], n_max, n_min)
        assert index.tokens == stream[:length]
        assert index.occurrences(len(stream)) == (n, starts), length
        assert index.occurrences(2) == (n, starts[:2])
        assert index.continuations(starts[:1], 6) == [stream[s:min(s + 6, length)] for s in starts[:1]]
        found += bool(starts)
        step = rng.randrange(1, 5)  # a round commits one to several tokens
        index.extend(stream[length:length + step])
        length += step
    assert found > 10, "the stream should repeat its n-grams"


def test_matcher_edge_cases():
    assert NGramIndex([], 3, 1).occurrences(4) == (0, []) == reference_occurrences([], 3, 1)
    assert NGramIndex([5], 3, 1).occurrences(4) == (0, [])  # a one-token history has nothing earlier
    assert NGramIndex([1, 2, 3, 4], 2, 1).occurrences(4) == (0, [])  # no repeat at all
    index = NGramIndex([7, 8, 9, 7, 8], 2, 1)  # k larger than what follows the match
    n, starts = index.occurrences(1)
    assert (n, starts) == (2, [2]) and index.continuations(starts, 10) == [[9, 7, 8]]
    index = NGramIndex([1, 2, 3, 4, 1], 2, 2)  # the suffix [1, 2] spans the prompt/output boundary
    assert index.occurrences(1) == (0, [])
    index.extend([2])
    assert index.occurrences(1) == (2, [2]) and index.continuations([2], 3) == [[3, 4, 1]]
    assert NGramIndex([3, 3], 2, 1).occurrences(3) == (1, [1])  # overlaps its own suffix


def test_continuation_tree_merges_shared_prefixes_within_the_budget():
    rng = random.Random(1)
    for _ in range(200):
        sequences = [[rng.randrange(3) for _ in range(rng.randrange(1, 6))] for _ in range(rng.randrange(1, 7))]
        budget = rng.randrange(2, 20)
        tokens, parents = continuation_tree(sequences, budget)
        assert parents[0] == -1 and tokens[0] == -1 and len(tokens) == len(parents) <= budget
        paths = [()]
        for i in range(1, len(tokens)):
            assert 0 <= parents[i] < i
            paths.append(paths[parents[i]] + (tokens[i],))
        assert len(set(paths)) == len(paths), "siblings must be distinct tokens"
        prefixes = {tuple(s[:j]) for s in sequences for j in range(len(s) + 1)}
        assert set(paths) <= prefixes
        if budget >= len(prefixes):
            assert set(paths) == prefixes
        counts = {p: sum(tuple(s[:len(p)]) == p for s in sequences) for p in prefixes}
        kept = [counts[p] for p in paths[1:]]
        dropped = [counts[p] for p in prefixes - set(paths)]
        assert not dropped or min(kept, default=len(sequences)) >= max(dropped), "the most shared nodes are kept"


def text_drafter(policy: NGram, histories: list[list[int]]) -> TextDrafter:
    policy.start(len(histories))
    drafter = TextDrafter(policy)
    drafter.start(histories, capacity=0, sampler=Sampler())
    return drafter


def keep_rows(policy: NGram, drafter: TextDrafter, rows: list[int]) -> None:
    policy.keep_rows(rows)
    drafter.keep_rows(rows, torch.tensor(rows))


def test_drafts_shrink_as_the_batch_grows_and_grow_back_as_rows_finish():
    policy = NGram(k=10, max_nodes=32, round_tokens=32)
    drafter = text_drafter(policy, [list(range(20)) * 3] * 8)  # every row repeats: full-length matches
    assert [len(c) for c in drafter.chains()] == [3] * 8  # 32 // 8 - 1
    assert [len(t) for t, _ in drafter.trees()] == [4] * 8  # 32 // 8 nodes
    keep_rows(policy, drafter, [5])
    assert [len(c) for c in drafter.chains()] == [10] and [len(t) for t, _ in drafter.trees()] == [11]


def test_adapt_depth_doubles_after_full_acceptance_and_cuts_to_one_past_the_accepted():
    policy = NGram(k=8, tree=False, adapt_depth=True)
    drafter = text_drafter(policy, [list(range(20)) * 3, list(range(20)) * 3, [1, 2, 3]])  # rows 0, 1 match
    depths = []
    for accepted in ([3, 8, 0], [0, 8, 0], [1, 8, 0], [2, 8, 0], [4, 8, 0], [8, 8, 0]):
        drafts = drafter.chains()
        depths.append([len(d) for d in drafts])
        policy.observe([len(d) for d in drafts], accepted)
    assert depths == [[8, 8, 0], [4, 8, 0], [1, 8, 0], [2, 8, 0], [4, 8, 0], [8, 8, 0]]
    policy.observe([8, 8, 0], [5, 8, 0])
    keep_rows(policy, drafter, [2, 1, 0])  # each depth goes with its row
    (lone, _), (deep, _), (tokens, parents) = drafter.trees()
    assert len(lone) == 1 and len(deep) == 9  # no match: the root alone; row 1 kept its 8
    assert len(tokens) == 7 and parents == [-1, 0, 1, 2, 3, 4, 5]  # equal continuations: a chain of 6
    drafter = text_drafter(policy, [list(range(20)) * 3] * 8)  # at batch 8 the budget cuts the chains to 3
    policy.proposed([3] * 8)
    policy.observe([3] * 8, [3] * 8)
    keep_rows(policy, drafter, [0])
    assert len(drafter.chains()[0]) == 8  # a full accept of a cut chain does not lower the depth
    without = NGram(k=8, tree=False)
    drafter = text_drafter(without, [list(range(20)) * 3])
    without.observe([8], [0])
    assert len(drafter.chains()[0]) == 8


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="k, draft_k: must be >= 1"):
        NGram(k=0)
    with pytest.raises(ValueError, match="n_min, n_max: need 1 <= n_min <= n_max"):
        NGram(n_max=2, n_min=3)
    with pytest.raises(ValueError, match="max_nodes, max_continuations"):
        NGram(tree=True, max_nodes=1)
    with pytest.raises(ValueError, match="round_tokens: must be >= 2"):
        NGram(round_tokens=1)


# ------------------------------------------------------------------------ greedy, end to end
@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5], [40], [9, 9, 9, 9, 9, 12], [70, 71, 60, 70, 71]]
SETTINGS = {"chain": dict(tree=False), "tree": dict(tree=True, max_nodes=12),
            "chain n=3..2": dict(tree=False, n_max=3, n_min=2),
            "tree n=2..2": dict(tree=True, n_max=2, n_min=2, max_nodes=8, draft_k=3),
            "chain adapt_depth": dict(tree=False, adapt_depth=True), "tree adapt_depth": dict(adapt_depth=True)}


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "beside the draft"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_ragged_batch_with_eos_equals_target(pair, setting, with_draft):
    target, draft = pair
    out = ragged_greedy_equals_target(target, draft if with_draft else None, PROMPTS, NGram(**SETTINGS[setting]))
    stats = out.stats
    assert stats.matched > 0 and stats.accepted > 0, stats
    assert (sum(stats.row_rounds), sum(stats.row_matched), sum(stats.row_drafted), sum(stats.row_accepted)) == \
        (stats.rounds, stats.matched, stats.drafted, stats.accepted)
    assert (stats.draft_calls > 0) == with_draft  # some rounds have a row the text has no match for
    assert stats.as_dict()["per_row"]["matched"] == stats.row_matched


def test_accelerate_without_a_draft_is_a_drop_in_for_generate(pair):
    target, _ = pair
    fast = spec_ext.accelerate(target, None, policy="ngram")
    ids = torch.tensor([[5, 17, 33, 8, 5, 17]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0), expected)
    assert fast.last_stats.draft_calls == 0 and fast.last_stats.matched > 0
    with pytest.raises(ValueError, match="draft: required \\(None only with NGram"):
        spec_ext.generate(target, None, ids, policy="fixed")


class Recording(TextDrafter):
    """The text drafter, recording at every round each row's history and the drafts it proposed."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.seen = []

    def chains(self):
        drafts = super().chains()
        self.seen += [(list(index.tokens), chain) for index, chain in zip(self.rows, drafts)]
        return drafts


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "beside the draft"])
def test_drafts_are_the_plain_lookup_of_prompt_and_output(pair, with_draft):
    """Every round's drafts are what the plain scan finds in the row's prompt + output so far
    (n-grams that span the prompt/output boundary included), k larger than what follows the
    match included; one-token prompts draft nothing in their first round."""
    target, draft = pair
    # a prompt whose last token and the target's next one occurred together at its start
    spans = next(p for p in ([q[-1], hf_greedy(target, q, 1, eos=[])[0], 50] + q for q in
                             ([k, k + 1, k + 2] for k in range(10, 60))) if hf_greedy(target, p, 1, eos=[])[0] == p[1])
    prompts = [spans, [11], [20, 21, 22, 20, 21, 22, 20]]
    policy = NGram(k=4, n_max=2, n_min=2, tree=False)
    recording = Recording(policy)
    drafter = TextFirst(recording, ModelDrafter(draft, policy)) if with_draft else recording
    out = spec_ext.generate(target, drafter, prompts, max_new_tokens=24, eos_token_id=[])
    finals = [prompt + out.sequences[b, -24:].tolist() for b, prompt in enumerate(prompts)]
    spanning = short = 0
    for history, chain in recording.seen:
        row = next(b for b, final in enumerate(finals) if final[:len(history)] == history)
        n, starts = reference_occurrences(history, 2, 2)
        assert chain == (history[starts[0]:starts[0] + 4] if starts else [])
        spanning += bool(starts) and len(history) - n < len(prompts[row]) < len(history)
        short += 0 < len(chain) < 4
    # alone, the first round emits one token, so the next suffix spans the boundary (beside the
    # draft, that round's drafts usually carry the row past it)
    assert short and (spanning or with_draft), (spanning, short)
    assert recording.seen[1] == ([11], [])  # the one-token prompt, first round
    for b, prompt in enumerate(prompts):
        assert out.sequences[b, -24:].tolist() == hf_greedy(target, prompt, 24, eos=[]), f"row {b}"


@pytest.mark.parametrize("tree", [False, True])
def test_no_match_ever_drafts_nothing_and_emits_one_token_per_round(pair, tree):
    target, _ = pair
    prompt, new = [5, 17, 33, 8], 12
    history = prompt + hf_greedy(target, prompt, new, eos=[])
    n = next(n for n in range(1, len(history)) if all(reference_occurrences(history[:j], n, n) == (0, [])
                                                       for j in range(1, len(history) + 1)))
    out = spec_ext.generate(target, None, [prompt, [6]], max_new_tokens=new, eos_token_id=[],
                            policy=NGram(n_max=n, n_min=n, tree=tree))
    assert out.sequences[0, -new:].tolist() == history[len(prompt):]
    assert out.sequences[1, -new:].tolist() == hf_greedy(target, [6], new, eos=[])
    assert out.stats.row_matched[0] == 0 and out.stats.row_drafted[0] == 0 and out.stats.row_rounds[0] == new


# ------------------------------------------------------------------------ exact distribution
REPEATING = [1, 3, 5, 1, 3, 5, 1, 3]


@pytest.fixture(scope="module")
def sampling_pair():
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    return target, perturbed(target, 0.01, seed=11)


@pytest.mark.parametrize("tree,with_draft,temperature,top_k", [(False, False, 1.0, None), (True, False, 0.7, 5),
                                                                (False, True, 0.7, 5), (True, True, 1.0, None)],
                         ids=["chain alone T=1", "tree alone T=0.7 top-k", "chain beside the draft T=0.7 top-k",
                              "tree beside the draft T=1"])
def test_sampling_follows_target_distribution(sampling_pair, tree, with_draft, temperature, top_k):
    target, draft = sampling_pair
    n = 20_000
    # n-grams of 2: the prompt's suffix always matches; later rows match or not as they were sampled,
    # so beside a draft both the text and the draft model draft in the same rounds
    policy = NGram(k=3, n_max=2, n_min=2, tree=tree, max_nodes=6, draft_k=2, round_tokens=6 * n)
    out = spec_ext.generate(target, draft if with_draft else None, [REPEATING] * n, max_new_tokens=3,
                            temperature=temperature, top_k=top_k, eos_token_id=[], policy=policy,
                            seed=int(100 * temperature) + 2 * tree + with_draft)
    samples = out.sequences[:, len(REPEATING):].numpy()
    assert_follows(samples, exact_joint(target, Sampler(temperature, top_k), prompt=REPEATING))
    stats = out.stats
    assert stats.matched > 0 and stats.drafted > 0 and stats.accepted > 0, stats
    if with_draft:
        assert stats.draft_calls > 0 and stats.matched < stats.rounds
    assert np.isin(samples, np.arange(VOCAB)).all()


def test_the_command_line_needs_a_draft_model_unless_the_policy_is_ngram(tmp_path):
    import subprocess
    import sys
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "spec_ext", "generate", "--target", str(tmp_path), "--prompt", "x",
                          "--policy", "fixed"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().endswith(
        "--draft: required with --policy fixed (only ngram and suffix draft without a draft model)"), out.stderr
