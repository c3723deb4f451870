"""Learned draft-length policies: their training labels against the loop itself, the
predictor file format, the policies' decisions, and the bundled predictors on the bundled pair.
(Exactness of both policies is in test_decoding, which runs every registered policy.)"""
from pathlib import Path

import pytest
import torch

import spec_ext
from spec_ext.learned import (AdaLength, BranchPredictor, LearnedSpecBranch, ResidualMLP, SpecDecPP,
                              asymmetric_l1, branch_classes, features_and_labels, train_predictor)
from spec_ext.parallel import ACCEPT_ALL, REJECT_ALL, PEARL
from spec_ext.policies import Fixed
from test_decoding import hf_greedy, llama, perturbed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.004, seed=1)


def constant(width: int, outputs: tuple[float, ...]) -> ResidualMLP:
    model = ResidualMLP(width, out_features=len(outputs))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.out.bias.copy_(torch.tensor(outputs))
    return model


def test_greedy_length_labels_equal_the_loops_accepted_counts(pair):
    target, draft = pair
    prompt = [5, 17, 33, 8]
    sequence = prompt + hf_greedy(target, prompt, 40, eos=[])
    data = features_and_labels(target, draft, torch.tensor([sequence]), start=len(prompt), greedy=True,
                               max_length=6)
    for n, i in enumerate(range(len(prompt) - 1, len(sequence) - 7)):
        out = spec_ext.generate(target, draft, [sequence[:i + 2]], max_new_tokens=1, eos_token_id=[],
                                policy=Fixed(6))
        assert data["adalength_y"][n].item() == out.stats.accepted_lengths[0], f"root at {i + 1}"
    assert data["adalength_y"].max() > 0 and data["adalength_y"].min() < 6


def test_acceptance_labels_against_prefix_forwards(pair):
    target, draft = pair
    torch.manual_seed(0)
    sequences = torch.randint(3, 97, (2, 30))
    greedy = features_and_labels(target, draft, sequences, start=10, greedy=True, max_length=4)
    sampled = features_and_labels(target, draft, sequences, start=10, greedy=False, max_length=4)
    ends = list(range(9, 30 - 1 - 4))
    assert greedy["specdecpp_y"].shape == (2 * len(ends),)
    with torch.no_grad():
        for row in range(2):
            for n, i in enumerate(ends):
                p = torch.softmax(target(sequences[row:row + 1, :i + 1]).logits[0, -1], -1)
                q = torch.softmax(draft(sequences[row:row + 1, :i + 1]).logits[0, -1], -1)
                k = row * len(ends) + n
                assert greedy["specdecpp_y"][k].item() == float(p.argmax() == q.argmax())
                torch.testing.assert_close(sampled["specdecpp_y"][k], torch.minimum(p, q).sum(), atol=1e-5, rtol=0)
    assert greedy["adalength_x"].shape == (2 * len(ends), 128)
    assert greedy["specdecpp_x"].shape == (2 * len(ends), 64)
    with pytest.raises(ValueError, match="sequences: need more than"):
        features_and_labels(target, draft, sequences[:, :12], start=10, greedy=True, max_length=4)


def test_asymmetric_l1_weights_under_prediction():
    prediction, target = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 1.0])
    assert asymmetric_l1(prediction, target, under_weight=3.0).item() == pytest.approx((3 * 1 + 1) / 2)


def test_train_predictor_fits_both_columns():
    torch.manual_seed(0)
    x = torch.randn(4000, 8)
    w = torch.randn(8)
    probability = torch.sigmoid(2 * x @ w)
    length = (x[:, 0].abs() * 3).round()
    model = ResidualMLP(8, hidden=64)
    history = train_predictor(model, {0: (x, probability), 1: (x, 1 - probability)}, "bce", epochs=15,
                              batch=128, progress=False)
    assert history[-1] < history[0]
    with torch.no_grad():
        predicted = torch.sigmoid(model(x))
    assert (predicted[:, 0] - probability).abs().mean() < 0.05
    assert (predicted[:, 1] - (1 - probability)).abs().mean() < 0.05
    model = ResidualMLP(8, hidden=64)
    train_predictor(model, {0: (x, length), 1: (x, length)}, "asymmetric_l1", epochs=15, batch=128,
                    progress=False)
    with torch.no_grad():
        under = (model(x)[:, 0] < length).float().mean()
    assert under < 0.5, "under-prediction costs more, so it should be the rarer error"
    with pytest.raises(ValueError, match="loss: expected"):
        train_predictor(model, {0: (x, length)}, "mse")


def test_predictor_file_round_trip(tmp_path):
    model = ResidualMLP(12, hidden=32, depth=1)
    model.save(tmp_path / "p.safetensors", kind="specdecpp", threshold=0.6, max_draft=7)
    loaded, settings = ResidualMLP.load(tmp_path / "p.safetensors")
    x = torch.randn(5, 12)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert settings == dict(kind="specdecpp", threshold=0.6, max_draft=7)
    policy = SpecDecPP(tmp_path / "p.safetensors")
    assert (policy.threshold, policy.max_draft) == (0.6, 7)
    with pytest.raises(ValueError, match="holds a 'specdecpp' predictor, not 'adalength'"):
        AdaLength(tmp_path / "p.safetensors")
    with pytest.raises(ValueError, match="predictor: .* not found"):
        SpecDecPP(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="threshold: must be in"):
        SpecDecPP(model, threshold=1.5)


def test_specdecpp_stops_when_predicted_rejection_exceeds_threshold(pair):
    target, draft = pair
    # constant acceptance 0.8: 1 - 0.8^3 = 0.49 <= 0.5 < 1 - 0.8^4, so every round drafts 4
    logit = torch.logit(torch.tensor(0.8)).item()
    policy = SpecDecPP(constant(64, (logit, -5.0)), threshold=0.5, max_draft=12)
    out = spec_ext.generate(target, draft, [[5, 6, 7], [8, 9]], max_new_tokens=20, eos_token_id=[], policy=policy)
    assert set(out.stats.draft_lengths) == {4}
    out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=20, eos_token_id=[], policy=policy,
                            temperature=1.0, seed=0)  # sampling reads the second column: acceptance ~0.007
    assert set(out.stats.draft_lengths) == {1}


def test_adalength_drafts_the_predicted_length(pair):
    target, draft = pair
    policy = AdaLength(constant(128, (2.3, 0.2)), offset=0.0, max_draft=12)
    out = spec_ext.generate(target, draft, [[5, 6, 7], [8, 9]], max_new_tokens=20, eos_token_id=[], policy=policy)
    assert set(out.stats.draft_lengths) == {3}
    out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=20, eos_token_id=[], policy=policy,
                            temperature=1.0, seed=0)
    assert set(out.stats.draft_lengths) == {1}
    with pytest.raises(ValueError, match="predictor: the AdaLength predictor takes 128 features but"):
        small = llama(97, 32, 1, seed=3)
        spec_ext.generate(small, small, [[5, 6]], policy=AdaLength(constant(128, (1, 1))))
    big = llama(97, 96, 1, seed=4)
    with pytest.raises(ValueError, match="predictor: the SpecDecPP predictor takes 64 features but"):
        spec_ext.generate(target, big, [[5, 6]], policy=SpecDecPP(constant(64, (1, 1))))


def test_branch_classes():
    lengths = torch.tensor([0.0, 0.4, 1.0, 3.9, 4.0, 7.0])
    assert branch_classes(lengths, accept_all_length=4).tolist() == [0, 0, 1, 1, 2, 2]


def test_branch_predictor_steers_the_branches(pair):
    target, draft = pair
    drafted = {}
    for hint in (ACCEPT_ALL, REJECT_ALL):
        outputs = [0.0] * 6
        outputs[hint] = outputs[3 + hint] = 10.0
        policy = LearnedSpecBranch(branches=4, gamma=3, predictor=constant(128, tuple(outputs)))
        out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=30, eos_token_id=[], policy=policy)
        assert out.sequences[0, 3:].tolist() == hf_greedy(target, [5, 6, 7], 30, eos=[])
        drafted[hint] = out.stats.drafted / out.stats.rounds
    chain = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=30, eos_token_id=[], policy=PEARL(gamma=3))
    # REJECT_ALL forks every fresh root 4 ways; ACCEPT_ALL stops forking after the first verdict
    assert drafted[REJECT_ALL] > drafted[ACCEPT_ALL] and drafted[REJECT_ALL] > chain.stats.drafted / chain.stats.rounds
    with pytest.raises(ValueError, match="predictor: a branch predictor has 6 outputs"):
        BranchPredictor(ResidualMLP(128))


@pytest.mark.parametrize("name", ["specdecpp", "adalength", "learnedspecbranch"])
def test_bundled_predictors_run_exactly_on_the_bundled_pair(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "stdlib-target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "stdlib-draft", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "stdlib-target")
    ids = tokenizer("import os\n\n\ndef read_config(path):\n", return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False, eos_token_id=None,
                               pad_token_id=tokenizer.pad_token_id)
    out = spec_ext.generate(target, draft, ids, max_new_tokens=48, eos_token_id=[], policy=name)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0 and len(set(out.stats.draft_lengths)) > 1, "a learned policy varies its length"
