"""The learned length policies (SpecDecPP, AdaLength) with feature heads: decoding stays exact
(greedy equal to ``target.generate``, sampling the target's law), SpecDecPP reads what the
head's output layer read, the training data of a head comes from its own chains (checked
against the head run one step at a time), the replay reads runs and grids (a draft model's
numbers unchanged), and benchmarks/train_policies.py trains both for a head end to end."""
import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch

import spec_ext
from spec_ext.drafters import Sampler
from spec_ext.models import SpecCache, aux_layer_ids
from spec_ext.policies import AdaLength, ResidualMLP, SpecDecPP
from spec_ext.policies.learned import DRAFT_EXTRA_FEATURES, HISTORY_FEATURES, draft_features
from spec_ext.training import (MAX_LENGTH, accepted_runs, decision_ms, features_and_labels, replay,
                               simulated_tokens_per_ms, steps_ahead)
from helpers import (PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy, llama, perturbed,
                     ragged_greedy_equals_target)
from test_heads import PROMPTS, V, echo_head, random_head

ROOT = Path(__file__).resolve().parents[1]


def replanned(policy_class, change):
    """``policy_class`` whose controllers hand every plan through ``change(plan) -> plan``."""
    class Replanned(policy_class):
        def start(self, call):
            controller = super().start(call)
            plan = controller.plan
            controller.plan = lambda state: change(plan(state))
            return controller
    return Replanned


@pytest.fixture(scope="module")
def target():
    return llama(V, 32, 4, seed=3, sharpen=3.0)


def specdecpp(head, threshold=0.6, seed=0):
    """An untrained SpecDecPP predictor for ``head``, its output scaled up so its predicted
    acceptance swings with the hidden state: rounds stop after varied numbers of drafts."""
    torch.manual_seed(seed)
    predictor = ResidualMLP(head.hidden_size + DRAFT_EXTRA_FEATURES, hidden=16, depth=1)
    with torch.no_grad():
        predictor.out.weight.mul_(20.0)
        predictor.out.bias.fill_(2.0)
    return SpecDecPP(predictor, threshold=threshold, max_draft=6)


def adalength(target, seed=0):
    torch.manual_seed(seed)
    return AdaLength(ResidualMLP(2 * target.config.hidden_size + HISTORY_FEATURES), offset=2.0, max_draft=6)


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("policy", ["specdecpp", "adalength"])
def test_greedy_equals_the_target_with_learned_lengths_and_a_head(target, kind, policy):
    """Ragged batch with EOS; the lengths vary, drafts are accepted and rejected."""
    head = echo_head(target, kind, draft_vocab=10 if kind == "eagle3" else None, noise=0.01)
    chosen = specdecpp(head) if policy == "specdecpp" else adalength(target)
    out = ragged_greedy_equals_target(target, head, PROMPTS, chosen, max_new=24)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats
    assert len(set(out.stats.draft_lengths)) > 1, out.stats.draft_lengths


@pytest.mark.parametrize("kind,norm_output", [("eagle3", False), ("eagle3", True), ("eagle", False)])
@torch.no_grad()
def test_specdecpp_reads_what_the_heads_output_layer_read(target, kind, norm_output):
    """At every draft step, the hidden state SpecDecPP gets gives, through the head's output
    layer (EAGLE-3: lm_head over the draft vocabulary; EAGLE-1: the target's lm_head), the
    distribution the draft was drawn from."""
    head = echo_head(target, kind, draft_vocab=10 if kind == "eagle3" else None, noise=0.05)
    head.config.norm_output = norm_output
    seen = []

    def recording(decided):  # every plan's keep_drafting records what it reads
        def recorded(step, probs, tokens, hidden=None):
            seen.append((probs, hidden))
            return decided.stop(step, probs, tokens, hidden)
        return dataclasses.replace(decided, stop=recorded)

    policy = replanned(SpecDecPP, recording)(specdecpp(head).predictor, threshold=0.6, max_draft=6)
    spec_ext.generate(target, head, PROMPTS, max_new_tokens=12, eos_token_id=[], policy=policy)
    assert len(seen) > 3
    draft_ids = torch.arange(head.d2t.shape[0]) + head.d2t if kind == "eagle3" else None
    for probs, hidden in seen:
        if kind == "eagle3":
            expected = torch.zeros_like(probs)
            expected[:, draft_ids] = torch.softmax(head.lm_head(hidden), -1)
        else:
            expected = torch.softmax(target.lm_head(hidden), -1)
        torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)


def test_sampling_follows_the_target_with_adalength_and_a_head():
    """A draft vocabulary of 5 of the 8 tokens; AdaLength's bonus agreement is drawn (the
    generator's stream changes, the law must not): the first 3 tokens' joint law is the
    target's, by enumeration."""
    target = llama(VOCAB, 32, 4, seed=10, sharpen=3.0)
    head = echo_head(target, draft_vocab=5, noise=0.05, seed=4)
    policy = AdaLength(ResidualMLP(2 * 32 + HISTORY_FEATURES), offset=1.0, max_draft=3)
    out = spec_ext.generate(target, head, [PROMPT] * 20_000, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                            policy=policy, seed=7)
    assert 0 < out.stats.accepted < out.stats.drafted
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(1.0)))


def test_bonus_agreement_of_a_head_is_its_catch_up_before_the_bonus(target):
    """AdaLength's agreements as the head drafter reports them: after a round that accepted
    every draft, whether the catch-up's output before the bonus (the last accepted draft
    paired with the target's feature) proposes the bonus token; after any other, False."""
    head = echo_head(target, draft_vocab=10, noise=0.03)
    reports = []

    def recording(decided):  # every plan's budget records the agreements the drafter hands it
        def recorded(agreed):
            reports.append(agreed.tolist())
            return decided.after_catch_up(agreed)
        return dataclasses.replace(decided, after_catch_up=recorded)

    predictor = ResidualMLP(2 * 32 + HISTORY_FEATURES)
    with torch.no_grad():  # one draft per round after the first: accepted, the round accepted all
        for t in predictor.parameters():
            t.zero_()
        predictor.out.bias.fill_(1.0)
    prompt = [11, 10, 11]
    out = spec_ext.generate(target, head, [prompt], max_new_tokens=30, eos_token_id=[],
                            policy=replanned(AdaLength, recording)(predictor, offset=0.0, max_draft=4))
    sequence = out.sequences[0].tolist()
    with torch.no_grad():  # the head's step-0 drafts over the output, teacher forced (the catch-up's pairs)
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        features = torch.cat([states[k] for k in (4, 4, 4)], -1)
        n = len(sequence) - 1
        logits, _ = head(target.get_input_embeddings()(torch.tensor([sequence[1:]])), head.combine(features[:, :n]),
                         torch.arange(n)[None], SpecCache(head.num_layers, None, None, 1, 64))
    proposes = logits[0].argmax(-1).tolist()  # proposes[t]: the head's draft of token t+2
    # the first round emits the first token from the prompt's forward, no drafts: the head starts
    # after it, and its first round's agreement is False (no bonus yet)
    assert out.stats.draft_lengths[0] == 0
    root, expected, told_apart = len(prompt), [], 0
    for drafted, accepted in zip(out.stats.draft_lengths[1:], out.stats.accepted_lengths[1:]):
        bonus = root + accepted + 1
        expected.append([accepted == drafted and proposes[bonus - 2] == sequence[bonus]])
        # the bonus's own pair proposes something else: reading it instead would show
        told_apart += accepted == drafted and proposes[bonus - 2] != proposes[bonus - 1]
        root = bonus
    assert reports == [[False]] + expected[:len(reports) - 1]
    accepted_all = [a == d for a, d in zip(out.stats.accepted_lengths[1:], out.stats.draft_lengths[1:])]
    outcomes = {agreed for (agreed,), whole in zip(reports[1:], accepted_all) if whole}
    assert outcomes == {True, False}, "rounds that accepted every draft, then agreed with the bonus or not"
    assert told_apart > 0


# ---------------------------------------------------------------------------- training data
def chain_by_steps(head, embed, tokens, features, root, steps):
    """The drafting forward of inference (a cache, one step at a time) for the round rooted at
    token ``root``: the pairs (x_{t+1}, feature_t) up to t = root - 1, then steps on the head's
    own outputs with the text's tokens. Per step: what lm_head reads [H] and the logits over
    the draft vocabulary, for the steps whose token exists."""
    cache = SpecCache(head.num_layers, None, None, 1, 64)
    t = root - 1
    out = []
    _, hidden = head(embed(tokens[None, 1:t + 2]), head.combine(features[None, :t + 1]), torch.arange(t + 1)[None],
                     cache)
    cache.advance([t + 1])
    hidden = hidden[:, t:t + 1]
    for s in range(steps):
        normed = hidden if head.config.norm_output else head.norm(hidden)
        out.append((normed[0, 0], head.lm_head(normed[0, 0])))
        if root + s + 1 > len(tokens) - 1 or s == steps - 1:
            break
        _, hidden = head(embed(tokens[None, root + s + 1:root + s + 2]), hidden, torch.tensor([[t + 1 + s]]), cache)
        cache.advance([1])
    return out


@pytest.mark.parametrize("which", ["echo", "random"])
@torch.no_grad()
def test_head_training_data_against_its_chains_run_step_by_step(target, which):
    """Every key of features_and_labels for a head, on a greedy continuation, from the head's
    drafting forward run root by root and step by step (the random head reads the target's
    default layers, (2, 2, 1) here: in the drafter's order, not sorted)."""
    if which == "echo":
        head = echo_head(target, draft_vocab=10, noise=0.01)
        layers = (4, 4, 4)
    else:
        head = random_head(target, draft_vocab=10, seed=2)
        layers = aux_layer_ids(target)
    prompt, M = [3, 1, 2, 3, 4, 5, 6, 7, 8], 4  # its continuation falls into repeating 7s
    sequence = torch.tensor([prompt + hf_greedy(target, prompt, 16, eos=[])] * 2)
    sequence[1, 12] = 3  # a second row that leaves the target's path
    start = len(prompt)
    N, L = sequence.shape
    data = features_and_labels(target, head, sequence, start, max_length=M, generator=torch.Generator().manual_seed(5),
                               step_grid=True)
    out = target(sequence, output_hidden_states=True)
    p = torch.softmax(out.logits, -1)
    features = torch.cat([out.hidden_states[k] for k in layers], -1)
    embed, draft_ids = target.get_input_embeddings(), torch.arange(10) + head.d2t
    greedy, sampling = torch.zeros(N, L, M), torch.zeros(N, L, M)
    lm_input = {}
    for n in range(N):
        for root in range(1, L):
            for s, (normed, logits) in enumerate(chain_by_steps(head, embed, sequence[n], features[n], root, M)):
                q = torch.softmax(logits, -1)
                greedy[n, root, s] = float(draft_ids[q.argmax()] == p[n, root + s].argmax())
                sampling[n, root, s] = torch.minimum(p[n, root + s, draft_ids], q).sum()
                lm_input[n, root, s] = normed
    # the draws: every (root, step) of the sampling grid, then SpecDecPP's step per end
    generator = torch.Generator().manual_seed(5)
    drawn = (torch.rand(N, L, M, generator=generator) < sampling).float()
    ends = list(range(start - 1, L - 1 - M))
    steps = torch.randint(M, (N, len(ends)), generator=generator)

    def run(grid):  # accepted in a row from step 0
        count = 0
        while count < M and grid[count]:
            count += 1
        return count

    def before(grid, n, i):  # step-0 acceptances in a row at the roots up to i
        count = 0
        while count < M and i - count >= 0 and grid[n, i - count, 0]:
            count += 1
        return count

    assert data["sequence"].tolist() == [0] * len(ends) + [1] * len(ends)
    for n in range(N):
        for e, i in enumerate(ends):
            k = n * len(ends) + e
            assert data["chances_greedy"][k].tolist() == greedy[n, i].tolist()
            torch.testing.assert_close(data["chances_sampling"][k], sampling[n, i], atol=1e-5, rtol=0)
            assert data["runs_greedy"][k] == run(greedy[n, i]) and data["runs_sampling"][k] == run(drawn[n, i])
            assert data["adalength_y_greedy"][k] == run(greedy[n, i + 1])
            torch.testing.assert_close(data["adalength_y_sampling"][k], sampling[n, i + 1].cumprod(0).sum(),
                                       atol=1e-5, rtol=0)
            assert data["accepted_greedy"][k] == greedy[n, i, 0] and data["accepted_sampling"][k] == drawn[n, i, 0]
            for mode, grid in (("greedy", greedy), ("sampling", drawn)):
                count = before(grid, n, i)
                assert data[f"adalength_history_{mode}"][k].tolist() == [count / 4, float(count > 0)], (mode, k)
            s = int(steps[n, e])
            assert data["specdecpp_step"][k] == s
            assert data["specdecpp_y_greedy"][k] == greedy[n, i, s]
            torch.testing.assert_close(data["specdecpp_y_sampling"][k], sampling[n, i, s], atol=1e-5, rtol=0)
            for step in range(M):
                normed = lm_input[n, i, step]
                q = torch.softmax(head.lm_head(normed), -1)
                expected = draft_features(normed[None], q[None])[0]
                torch.testing.assert_close(data["specdecpp_x_grid"][k, step], expected, atol=1e-4, rtol=1e-4)
                if step == s:
                    torch.testing.assert_close(data["specdecpp_x"][k], expected, atol=1e-4, rtol=1e-4)
            embedded = embed.weight[sequence[n, i + 1]]
            torch.testing.assert_close(data["adalength_x"][k], torch.cat([embedded, out.hidden_states[-1][n, i]]))
    if which == "echo":  # the check is not vacuous: runs of every length, draws both ways
        assert set(data["runs_greedy"].tolist()) >= {0, M} and len(set(data["runs_greedy"].tolist())) > 2
    assert 0 < data["runs_sampling"].sum() and data["accepted_sampling"].min() == 0
    with pytest.raises(ValueError, match="start: a head's round"):
        features_and_labels(target, head, sequence, 1, max_length=M)
    with pytest.raises(ValueError, match="draft: an EAGLE-1 head"):
        features_and_labels(target, echo_head(target, "eagle"), sequence, start, max_length=M)


@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.004, seed=1)


@torch.no_grad()
def test_a_draft_models_runs_and_chances_are_its_per_position_acceptances(pair):
    """For a draft model the new keys are what the replay derived before: the runs of its
    per-position acceptances and the chances ahead of each root, at every root a replay visits
    (root + max_length <= P)."""
    target, draft = pair
    torch.manual_seed(0)
    sequences = torch.randint(3, 97, (2, 40))
    M = 5
    data = features_and_labels(target, draft, sequences, start=8, max_length=M)
    P = len(data["sequence"]) // 2
    visited = slice(0, P - M + 1)
    for mode in ("greedy", "sampling"):
        accept = data[f"accepted_{mode}"].view(2, P)
        runs = data[f"runs_{mode}"].view(2, P)
        assert torch.equal(runs[:, visited], accepted_runs(accept, M)[:, visited])
        chances = data[f"chances_{mode}"].view(2, P, M)
        ahead = steps_ahead(data[f"specdecpp_y_{mode}"].view(2, P), M)
        assert torch.equal(chances[:, visited], ahead[:, visited])
    with pytest.raises(ValueError, match="step_grid"):
        features_and_labels(target, draft, sequences, start=8, max_length=M, step_grid=True)


def test_the_replay_reads_runs_by_hand():
    """test_learned's hand-worked rounds, given as runs: a round rooted at j keeps
    min(runs[j], k) drafts plus the target's token."""
    # acceptances T T F T T T F F T T with max_length 3: the runs from each root
    runs = torch.tensor([[2, 1, 0, 3, 2, 1, 0, 0, 2, 1]])
    assert torch.equal(runs, accepted_runs(torch.tensor([[1., 1, 0, 1, 1, 1, 0, 0, 1, 1]]), 3).long())
    round_ms = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    # fixed 2: roots 0, 3, 6, 7 keep 2, 2, 0, 0: 8 tokens in 4 rounds of 12 ms
    assert simulated_tokens_per_ms(runs, torch.full((1, 10), 2), round_ms, 3) == (pytest.approx(8 / 48), 2.0)
    lengths = torch.tensor([[1, 5, 3, 3, 5, 5, 5, 1, 5, 5]])
    assert simulated_tokens_per_ms(runs, lengths, round_ms, 3) == (pytest.approx(8 / 48), 2.0)
    # replay() replays MAX_LENGTH-long rounds: one row of 2 * MAX_LENGTH roots, runs of 1
    ones = torch.ones(1, 2 * MAX_LENGTH, dtype=torch.long)
    rate, mean = replay(ones, {"k=1": torch.ones_like(ones)}, [1.0] * (MAX_LENGTH + 1))["k=1"]
    assert (rate, mean) == (2.0, 1.0)  # roots 0, 2, ..., MAX_LENGTH: 2 tokens per 1 ms round


# ---------------------------------------------------------------------------- costs, refusals, script
def test_specdecpp_sizes_its_predictor_by_the_heads_width(target):
    head = echo_head(target, draft_vocab=10)
    wrong = SpecDecPP(ResidualMLP(head.hidden_size + 1), threshold=0.5)
    with pytest.raises(ValueError, match=f"predictor: the SpecDecPP predictor takes {head.hidden_size + 1} features "
                                         f"but the head's hidden state and draft_features gives "
                                         f"{head.hidden_size + DRAFT_EXTRA_FEATURES}"):
        spec_ext.generate(target, head, PROMPTS, max_new_tokens=4, policy=wrong)


def test_decision_costs_with_a_head(target):
    head = echo_head(target, draft_vocab=10)
    predictors = dict(specdecpp=ResidualMLP(head.hidden_size + DRAFT_EXTRA_FEATURES),
                      adalength=ResidualMLP(2 * 32 + HISTORY_FEATURES))
    costs = decision_ms(predictors, target, head, batch=2, repeats=5)
    assert set(costs) == {"specdecpp_per_draft", "adalength_per_round"} and min(costs.values()) > 0


@pytest.mark.slow
def test_train_policies_for_a_head_end_to_end(tmp_path):
    """benchmarks/train_policies.py --head on a tiny random target (the bundled tokenizer) and
    a head made for it: both predictors and the report are written under HEAD/policies, and
    decode exactly."""
    from spec_ext.training.head import initial_head
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_policies
    target = llama(4096, 32, 2, seed=0, sharpen=4.0, max_positions=512)
    target.save_pretrained(tmp_path / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "stdlib-target" / name, tmp_path / "target" / name)
    initial_head(target, (0, 1, 2)).save(tmp_path / "head")
    train_policies.main(["--target", str(tmp_path / "target"), "--head", str(tmp_path / "head"),
                         "--work", str(tmp_path / "work"), "--sequences", "16", "--validation-sequences", "8",
                         "--prompt-tokens", "16", "--new-tokens", "32", "--epochs", "1", "--hidden", "8",
                         "--cost-prompts", "2", "--repeats", "1", "--batch", "2", "--threads", "1"])
    out = tmp_path / "head" / "policies"
    assert sorted(p.name for p in out.iterdir()) == ["adalength.safetensors", "specdecpp.safetensors",
                                                     "validation.json"]
    report = __import__("json").loads((out / "validation.json").read_text())
    assert "branch" not in report and report["pair"]["draft_kind"] == "feature head"
    assert set(report["replayed_on_validation"]["greedy"]) >= {"oracle", "chances known", "specdecpp threshold=0.5"}
    head = spec_ext.models.eagle.load_head(tmp_path / "head")
    for policy in (SpecDecPP(out / "specdecpp.safetensors"), AdaLength(out / "adalength.safetensors")):
        ragged_greedy_equals_target(target, head, [[5, 17, 33, 8], [9, 4]], policy, max_new=12)
