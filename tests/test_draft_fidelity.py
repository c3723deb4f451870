"""Draft fidelity: after every round's commit, whatever the target kept (all of the drafts,
some, none), a stateful drafter's next proposal equals what a fresh drafter of the same
kind, started on the committed text, proposes (greedy: proposals are deterministic). This
catches a drafter whose state drifts from the text (a cache not rolled back to what was
accepted, a head fed the wrong position's target feature) while its output stays exact, so
that no exactness test could see it; only its acceptance drops.

Rounds run chains and trees, untrimmed and trimmed after drafting (a policy whose plans'
``select`` cuts each row to a prefix or subtree, as adaptive verification does), and each
test checks that its rounds held full, partial and zero acceptance."""
import dataclasses
import random

import pytest
import torch

import spec_ext
from spec_ext.drafters import HeadDrafter, ModelDrafter, OtherTokenizerDrafter
from spec_ext.policies import DynamicTree, Fixed, Tree
from spec_ext.policies.adaptive import trim_chain, trim_tree
from helpers import llama, perturbed


def settings(policy) -> dict:
    """A policy's arguments (its dataclass fields), to make one of another class with them."""
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}


def with_trim(policy, trim):
    """``policy`` whose every plan selects what ``trim(plan, proposal)`` gives of its proposal
    (``RoundPlan.select``); ``untrimmed``: ``policy`` itself."""

    class Trimmed(type(policy)):
        untrimmed = getattr(policy, "untrimmed", policy)

        def start(self, call):
            controller = super().start(call)
            plan = controller.plan
            controller.plan = lambda state: (lambda p: dataclasses.replace(p, trim=lambda proposal: trim(p, proposal)))(
                plan(state))
            return controller

    return Trimmed(**settings(policy))


def trimming(base):
    """``base`` (a Fixed, Tree or DynamicTree) whose plans' ``select`` cuts every row at random
    (seeded) to a prefix of its chain or a subtree of its tree, sometimes to nothing."""
    rng = random.Random(0)

    def trim(plan, proposal):
        B, T = proposal.tokens.shape
        if not proposal.is_tree:
            return trim_chain(proposal, [rng.randint(0, n) for n in proposal.num_draft.tolist()])
        parents = proposal.parents.expand(B, T).tolist()
        kept = []
        for row in parents:
            nodes = {0}
            for i in range(1, T):
                if row[i] in nodes and rng.random() < 0.7:
                    nodes.add(i)
            kept.append(sorted(nodes - {0}))
        return trim_tree(proposal, kept, parents)

    return with_trim(base, trim)


def first_proposal(target, make_drafter, policy, seqs):
    """The first proposal a fresh ``make_drafter()`` makes under ``policy`` for the rows
    ``seqs`` as generate starts it: on ``seqs`` themselves or, where a call's first round
    drafts nothing (a drafter that reads the target's features, a tree: that round emits one
    token from the prompt's forward), in the second round of a call on ``seqs`` but their last
    tokens, which the first round emits again (greedy)."""
    seen = []

    def run(prompts, max_new):
        drafter = make_drafter()
        propose = drafter.propose

        def recording(rows, roots, plan, forced=None, forced_rows=None):
            proposal = propose(rows, roots, plan, forced, forced_rows)
            seen.append(([list(r) for r in rows], proposal))
            return proposal

        drafter.propose = recording
        spec_ext.generate(target, drafter, prompts, max_new_tokens=max_new, eos_token_id=[], policy=policy)

    run([list(s) for s in seqs], 1)
    if not seen:
        run([list(s[:-1]) for s in seqs], 2)
    rows, proposal = seen[0]
    assert rows == [list(s) for s in seqs], (rows, seqs)
    return proposal


def rows_of(proposal):
    """Per row: the chain's drafts, or the tree's (tokens, parents) of its present nodes."""
    B, T = proposal.tokens.shape
    counts = proposal.num_draft.tolist()
    if not proposal.is_tree:
        return [proposal.tokens[b, :n].tolist() for b, n in enumerate(counts)]
    parents = proposal.parents.expand(B, T).tolist()
    return [([t for t in proposal.tokens[b, 1:].tolist() if t >= 0], parents[b][1:1 + counts[b]]) for b in range(B)]


def check_fidelity(target, make_drafter, policy, prompts, max_new=24):
    """Run ``make_drafter()`` under ``policy`` over ``prompts`` (greedy, EOS none) and compare
    every proposal after the first with a fresh ``make_drafter()``'s first proposal (under the
    untrimmed policy) on the same committed rows. Returns per row and round (the depth of what
    was verified: a chain's drafts, a tree's deepest node; what was accepted)."""
    rounds, outcomes, depths = [], [], []  # depths: the round's, where it drafted (not a plain step)
    drafter = make_drafter()
    propose, commit = drafter.propose, drafter.commit

    def selecting(plan, proposal):
        verified = plan.select(proposal)
        if verified.is_tree:
            present = verified.tokens >= 0
            depths.append(torch.where(present, verified.depth.expand_as(present), 0).amax(1).tolist())
        else:
            depths.append(verified.num_draft.tolist())
        return verified

    def recording(seqs, roots, plan, forced=None, forced_rows=None):
        proposal = propose(seqs, roots, plan, forced, forced_rows)
        rounds.append(([list(s) for s in seqs], rows_of(proposal)))
        return proposal

    def committing(outcome):
        if depths:
            outcomes.extend(zip(depths.pop(), outcome.accepted))
        commit(outcome)

    drafter.propose, drafter.commit = recording, committing
    spec_ext.generate(target, drafter, prompts, max_new_tokens=max_new, eos_token_id=[],
                      policy=with_trim(policy, selecting))
    fresh = getattr(policy, "untrimmed", policy)
    for r, (seqs, proposed) in enumerate(rounds[1:], 1):
        expected = rows_of(first_proposal(target, make_drafter, fresh, seqs))
        for b, (got, want) in enumerate(zip(proposed, expected)):
            assert got == want, f"round {r}, row {b}: {got} != fresh drafter's {want}"
    return outcomes


def assert_varied(outcomes):
    """The rounds held rows that accepted as deep as they verified, less deep and nothing."""
    assert any(a == n > 0 for n, a in outcomes), outcomes
    assert any(0 < a < n for n, a in outcomes), outcomes
    assert any(a == 0 < n for n, a in outcomes), outcomes


SHAPES = {"chain": lambda: Fixed(3), "tree": lambda: Tree((2, 2, 1)),
          "dynamic": lambda: DynamicTree(depth=3, top_k=3, nodes=8)}


# ---------------------------------------------------------------------------- draft model
@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


@pytest.mark.parametrize("trimmed", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_draft_model_proposes_as_a_fresh_one_after_every_commit(pair, shape, trimmed):
    target, draft = pair
    policy = trimming(SHAPES[shape]()) if trimmed else SHAPES[shape]()
    outcomes = check_fidelity(target, lambda: ModelDrafter(draft), policy,
                              [[5, 17, 33, 8], [40, 2], [7, 7, 9, 1, 3, 11]])
    assert_varied(outcomes)


# ---------------------------------------------------------------------------- EAGLE head
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


@pytest.mark.parametrize("trimmed", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_head_proposes_as_a_fresh_one_after_every_commit(bundled, shape, trimmed):
    target, head, prompts = bundled
    policy = trimming(SHAPES[shape]()) if trimmed else SHAPES[shape]()
    outcomes = check_fidelity(target, lambda: HeadDrafter(head), policy, prompts, max_new=20)
    assert_varied(outcomes)


def check_waiting(target, head, prompts, vocab):
    """Run a head beside a text that drafts about every other round (the first always: the
    target's next 1-4 tokens, the last one spoiled at times, so accepted whole, in part or not
    at all), the head skipping those rounds (``HeadDrafter.skip``: no forward) and catching up
    over them in its next one: the output is the target's, and every proposal of the head,
    after one or more skipped rounds, equals a fresh head's on the committed text."""
    from helpers import hf_greedy
    from spec_ext.drafters.text import chain_proposal
    greedy = [p + hf_greedy(target, p, 48, None) for p in prompts]
    rng = random.Random(0)
    drafter = HeadDrafter(head)
    propose, commit = drafter.propose, drafter.commit
    head_rounds, waited, accepted = [], [], []  # per head round: (rows, proposal, rounds skipped just before)

    def proposing(seqs, roots, plan, forced=None, forced_rows=None):
        if not waited or rng.random() < 0.5:  # the text's round
            chains = []
            for seq, full in zip(seqs, greedy):
                chain = full[len(seq):len(seq) + rng.randint(1, 4)]
                if chain and rng.random() < 0.4:
                    chain[-1] = (chain[-1] + 1) % vocab
                chains.append(chain)
            drafter.skip()
            waited.append(True)
            return chain_proposal(chains, max(map(len, chains)), roots.device)
        proposal = propose(seqs, roots, plan, forced, forced_rows)
        skipped = len(waited) - max((i + 1 for i, w in enumerate(waited) if not w), default=0)
        head_rounds.append(([list(s) for s in seqs], rows_of(proposal), skipped))
        # what its cache keeps of the round: one pair per committed position before the root, no stand-in
        assert drafter._kept == [len(s) - 1 for s in seqs], (len(head_rounds), drafter._kept)
        waited.append(False)
        return proposal

    def committing(outcome):
        accepted.extend(outcome.accepted)
        commit(outcome)

    drafter.propose, drafter.commit = proposing, committing
    out = spec_ext.generate(target, drafter, prompts, max_new_tokens=40, eos_token_id=[], policy=Fixed(3))
    width = max(map(len, prompts))
    for b, p in enumerate(prompts):
        assert out.sequences[b, width:].tolist() == greedy[b][len(p):len(p) + 40]
    skips = [skipped for *_, skipped in head_rounds]
    assert sum(s > 0 for s in skips) >= 3 and max(skips) >= 2 and 0 in accepted and max(accepted) >= 3, (skips, accepted)
    for r, (seqs, proposed, skipped) in enumerate(head_rounds):
        expected = rows_of(first_proposal(target, lambda: HeadDrafter(head), Fixed(3), seqs))
        assert proposed == expected, f"head round {r} (after {skipped} skipped)"


@pytest.mark.parametrize("seed", range(4))
def test_join_columns_takes_each_rows_runs_in_order(seed):
    """What a waiting head and MTP's layers catch up over (``join_columns``): per row, its run
    of each part (from its own first column, its own count, zero counts too) in order, the
    ids and their features joined alike, features cast to the first part's dtype."""
    from spec_ext.drafters.features import join_columns
    g = torch.Generator().manual_seed(seed)
    B, parts, expected = 3, [], [[] for _ in range(3)]
    for p in range(int(torch.randint(1, 4, (), generator=g))):
        width = int(torch.randint(1, 6, (), generator=g))
        ids = torch.randint(0, 100, (B, width), generator=g)
        features = torch.randn(B, width, 2, generator=g, dtype=torch.float64 if p else torch.float32)
        firsts = [int(torch.randint(0, width, (), generator=g)) for _ in range(B)]
        counts = [int(torch.randint(0, width - f + 1, (), generator=g)) for f in firsts]
        counts[p % B] = max(counts[p % B], 1)
        parts.append(((ids, features), firsts, counts))
        for b in range(B):
            expected[b] += [(ids[b, j].item(), features[b, j].float())
                            for j in range(firsts[b], firsts[b] + counts[b])]
    (ids, features), totals = join_columns(parts)
    assert totals == [len(e) for e in expected] and ids.shape[1] == max(totals) and features.dtype == torch.float32
    for b, row in enumerate(expected):
        assert ids[b, :totals[b]].tolist() == [i for i, _ in row]
        if row:
            torch.testing.assert_close(features[b, :totals[b]], torch.stack([f for _, f in row]), rtol=0, atol=0)


def test_a_head_that_waits_out_rounds_proposes_as_a_fresh_one_after_them(bundled):
    """``check_waiting`` on the bundled pair, a one-token prompt among the rows (its stand-in
    pair must not reach the head's cache)."""
    target, head, prompts = bundled
    check_waiting(target, head, prompts + [prompts[0][:1]], 4096)


@pytest.mark.parametrize("model", ["qwen3", "gemma3", "gpt2"])
def test_a_head_that_waits_proposes_as_a_fresh_one_on_other_architectures(model):
    """``check_waiting`` on tiny random targets: qwen3 and gemma3 (sliding and full layers) on
    the lean forward, gpt2 on the HF modules; EAGLE-3 and the head's reduced vocabulary."""
    from test_architectures import sharpened_model
    from test_heads import echo_head
    layers = dict(layer_types=["sliding_attention", "full_attention"] * 2) if model == "gemma3" else {}
    target = sharpened_model(model, vocab=12, num_hidden_layers=4, **layers)
    check_waiting(target, echo_head(target, "eagle3", draft_vocab=10, noise=0.01), [[5, 7, 3, 8, 11, 4], [9, 4, 10],
                                                                                        [3], [3, 1, 2, 3, 4, 5, 6, 7]], 12)


def test_a_head_that_waits_while_one_row_commits_far_more_than_another_fits_its_cache():
    """Skipped rounds in which one row's text is accepted (3 tokens a round) and the other's
    drafts nothing, then the other way round: the rows' waiting pairs differ by far more than
    one round's drafts, and the catch-up, padded to the longest, still fits the head's cache
    (it grows: the capacity was sized for one round's difference); the proposals after
    equal a fresh head's, the output the target's."""
    from helpers import hf_greedy
    from spec_ext.drafters.text import chain_proposal
    from test_heads import echo_head
    target = llama(12, 32, 2, seed=2, sharpen=4.0)
    head = echo_head(target, draft_vocab=10)
    prompts = [[5, 7, 3, 8, 5, 7, 3, 9], [9, 4]]
    greedy = [p + hf_greedy(target, p, 60, None) for p in prompts]
    drafter = HeadDrafter(head)
    propose, rounds, head_rounds = drafter.propose, [0], []

    def proposing(seqs, roots, plan, forced=None, forced_rows=None):
        r = rounds[0]
        rounds[0] += 1
        if r == 7 or r >= 13:
            proposal = propose(seqs, roots, plan, forced, forced_rows)
            head_rounds.append(([list(s) for s in seqs], rows_of(proposal)))
            return proposal
        good = 0 if r < 7 else 1
        chains = [full[len(s):len(s) + 3] if b == good else [] for b, (s, full) in enumerate(zip(seqs, greedy))]
        drafter.skip()
        return chain_proposal(chains, max(map(len, chains)), roots.device)

    drafter.propose = proposing
    out = spec_ext.generate(target, drafter, prompts, max_new_tokens=40, eos_token_id=[], policy=Fixed(3))
    for b, p in enumerate(prompts):
        assert out.sequences[b, -40:].tolist() == greedy[b][len(p):len(p) + 40]
    assert len(head_rounds) >= 3
    for seqs, proposed in head_rounds[:3]:
        assert proposed == rows_of(first_proposal(target, lambda: HeadDrafter(head), Fixed(3), seqs))


# ---------------------------------------------------------------------------- another tokenizer
@pytest.mark.parametrize("mode", ["tli", "slem"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_draft_of_another_tokenizer_proposes_as_a_fresh_one_after_every_commit(mode, shape):
    from test_other_tokenizer import PROMPTS, tokenizer, trained
    target, draft = trained("bytes300", 0), trained("sp", 1)
    target_tok = tokenizer("bytes300")
    prompts = [target_tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    outcomes = check_fidelity(
        target, lambda: OtherTokenizerDrafter(draft, tokenizer("sp"), target_tok, mode=mode),
        trimming(SHAPES[shape]()), prompts, max_new=16)
    assert_varied(outcomes)
