"""Prompt lookup (NGram): the incremental matcher against the plain scan, continuation
trees, and the loop end to end on tiny random models (fp32, CPU): greedy output equals the
target's own, sampled output follows the target's exact distribution, alone and beside a
draft model, chains and trees."""
import random

import numpy as np
import pytest
import torch

import spec_ext
from spec_ext.drafters import Sampler, TextSource
from spec_ext.policies import Call, NGram, NGramIndex, Report, RoundState, continuation_tree
from spec_ext.reference import reference_occurrences
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


def lookup(policy: NGram, histories: list[list[int]]):
    """The policy's controller and the rows' text for a call on ``histories``."""
    text = TextSource(policy.text_settings(False))
    text.start(histories)
    return policy.start(Call(len(histories))), text


def offers(controller, text) -> list[int]:
    """The drafts (tree nodes, the root included) of each row's text offer this round (0: none)."""
    plan = controller.plan(RoundState(controller.rows, text))
    return [0 if t is None else len(t.tokens) for t in plan.text], plan


def observe(controller, plan, accepted) -> None:
    drafted = [0 if t is None else t.drafts for t in plan.text]
    controller.observe(Report(plan, plan.sources, drafted, accepted, [[0] * (a + 1) for a in accepted],
                              1 + max(drafted)))


def keep_rows(controller, text, rows: list[int]) -> None:
    controller.keep_rows(rows)
    text.keep_rows(rows)


def test_drafts_shrink_as_the_batch_grows_and_grow_back_as_rows_finish():
    for tree, at_8, alone in ((False, 3, 10), (True, 4, 11)):  # chains: 32 // 8 - 1; trees: 32 // 8 nodes
        controller, text = lookup(NGram(k=10, max_nodes=32, round_tokens=32, tree=tree),
                                  [list(range(20)) * 3] * 8)  # every row repeats: full-length matches
        assert offers(controller, text)[0] == [at_8] * 8
        keep_rows(controller, text, [5])
        assert offers(controller, text)[0] == [alone]


def test_adapt_depth_doubles_after_full_acceptance_and_cuts_to_one_past_the_accepted():
    policy = NGram(k=8, tree=False, adapt_depth=True)
    controller, text = lookup(policy, [list(range(20)) * 3, list(range(20)) * 3, [1, 2, 3]])  # rows 0, 1 match
    depths = []
    for accepted in ([3, 8, 0], [0, 8, 0], [1, 8, 0], [2, 8, 0], [4, 8, 0], [8, 8, 0]):
        lengths, plan = offers(controller, text)
        depths.append(lengths)
        observe(controller, plan, [min(a, n) for a, n in zip(accepted, lengths)])
    assert depths == [[8, 8, 0], [4, 8, 0], [1, 8, 0], [2, 8, 0], [4, 8, 0], [8, 8, 0]]
    lengths, plan = offers(controller, text)
    observe(controller, plan, [5, 8, 0])
    keep_rows(controller, text, [2, 1, 0])  # each depth goes with its row
    assert offers(controller, text)[0] == [0, 8, 6]  # no match; row 1 kept its 8; row 0 one past its 5
    controller, text = lookup(policy, [list(range(20)) * 3] * 8)  # at batch 8 the budget cuts the chains to 3
    lengths, plan = offers(controller, text)
    assert lengths == [3] * 8
    observe(controller, plan, [3] * 8)
    keep_rows(controller, text, [0])
    assert offers(controller, text)[0] == [8]  # a full accept of a cut chain does not lower the depth
    controller, text = lookup(NGram(k=8, tree=False), [list(range(20)) * 3])
    lengths, plan = offers(controller, text)
    observe(controller, plan, [0])
    assert offers(controller, text)[0] == [8]


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
    with pytest.raises(ValueError, match="draft: required with policy Fixed \\(None only with a policy that drafts from the text"):
        spec_ext.generate(target, None, ids, policy="fixed")


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "beside the draft"])
def test_drafts_are_the_plain_lookup_of_prompt_and_output(pair, with_draft, monkeypatch):
    """Every round's drafts are what the plain scan finds in the row's prompt + output so far
    (n-grams that span the prompt/output boundary included), k larger than what follows the
    match included; one-token prompts draft nothing in their first round."""
    target, draft = pair
    seen = []
    chain = TextSource.chain

    def recording(self, row, most):
        drafts = chain(self, row, most)
        seen.append((list(self.rows[row].tokens), drafts))
        return drafts
    monkeypatch.setattr(TextSource, "chain", recording)
    # a prompt whose last token and the target's next one occurred together at its start
    spans = next(p for p in ([q[-1], hf_greedy(target, q, 1, eos=[])[0], 50] + q for q in
                             ([k, k + 1, k + 2] for k in range(10, 60))) if hf_greedy(target, p, 1, eos=[])[0] == p[1])
    prompts = [spans, [11], [20, 21, 22, 20, 21, 22, 20]]
    policy = NGram(k=4, n_max=2, n_min=2, tree=False)
    out = spec_ext.generate(target, draft if with_draft else None, prompts, max_new_tokens=24, eos_token_id=[],
                            policy=policy)
    finals = [prompt + out.sequences[b, -24:].tolist() for b, prompt in enumerate(prompts)]
    spanning = short = 0
    for history, drafts in seen:
        row = next(b for b, final in enumerate(finals) if final[:len(history)] == history)
        n, starts = reference_occurrences(history, 2, 2)
        assert drafts == (history[starts[0]:starts[0] + 4] if starts else [])
        spanning += bool(starts) and len(history) - n < len(prompts[row]) < len(history)
        short += 0 < len(drafts) < 4
    # alone, the first round emits one token, so the next suffix spans the boundary (beside the
    # draft, that round's drafts usually carry the row past it)
    assert short and (spanning or with_draft), (spanning, short)
    assert seen[1] == ([11], [])  # the one-token prompt, first round
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
