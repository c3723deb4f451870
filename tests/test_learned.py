"""Learned draft-length policies: their training labels against the loop itself, the
predictor file format, the policies' decisions, and the bundled predictors on the bundled pair.
(Exactness of both policies is in test_decoding, which runs every registered policy.)"""
from pathlib import Path

import pytest
import torch

import spec_ext
from spec_ext.policies import (PEARL, AdaLength, BranchHint, BranchPredictor, Call, Fixed, LearnedSpecBranch, Report,
                               ResidualMLP, RoundState, Source, SpecDecPP)
from spec_ext.training import (accepted_runs, asymmetric_l1, branch_classes, features_and_labels,
                               simulated_batch_tokens_per_ms, simulated_tokens_per_ms, train_predictor)
from helpers import hf_greedy, llama, perturbed, plan_of

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
    data = features_and_labels(target, draft, torch.tensor([sequence]), start=len(prompt), max_length=6)
    for n, i in enumerate(range(len(prompt) - 1, len(sequence) - 7)):
        out = spec_ext.generate(target, draft, [sequence[:i + 2]], max_new_tokens=1, eos_token_id=[],
                                policy=Fixed(6))
        assert data["adalength_y_greedy"][n].item() == out.stats.accepted_lengths[0], f"root at {i + 1}"
    assert data["adalength_y_greedy"].max() > 0 and data["adalength_y_greedy"].min() < 6


def test_acceptance_labels_and_features_against_prefix_forwards(pair):
    target, draft = pair
    torch.manual_seed(0)
    sequences = torch.randint(3, 97, (2, 30))
    data = features_and_labels(target, draft, sequences, start=10, max_length=4)
    ends = list(range(9, 30 - 1 - 4))
    assert data["specdecpp_y_greedy"].shape == (2 * len(ends),)
    assert data["sequence"].tolist() == [0] * len(ends) + [1] * len(ends)
    with torch.no_grad():  # the sampling history's draws: generator seed 0 over [N,L] acceptance chances
        chances = torch.minimum(torch.softmax(target(sequences).logits, -1),
                                torch.softmax(draft(sequences).logits, -1))
        drawn_by_hand = torch.rand(sequences.shape, generator=torch.Generator().manual_seed(0)) < chances.sum(-1)
    assert torch.equal(drawn_by_hand[:, ends].flatten().float(), data["accepted_sampling"])
    errors = {"specdecpp_x": [], "adalength_x": []}
    with torch.no_grad():
        for row in range(2):
            p = torch.softmax(target(sequences[row:row + 1]).logits[0], -1)  # causal: row i sees tokens <= i
            q = torch.softmax(draft(sequences[row:row + 1]).logits[0], -1)
            accept = torch.minimum(p, q).sum(-1)
            agree = (p.argmax(-1) == q.argmax(-1)).tolist()
            for n, i in enumerate(ends):
                t_prefix = target(sequences[row:row + 1, :i + 1], output_hidden_states=True)
                d_prefix = draft(sequences[row:row + 1, :i + 1], output_hidden_states=True)
                p_i = torch.softmax(t_prefix.logits[0, -1], -1)
                q_i = torch.softmax(d_prefix.logits[0, -1], -1)
                k = row * len(ends) + n
                # the hidden states of the prefix's last token (the full forward is causal)
                hidden_error = data["specdecpp_x"][k, :-3] - d_prefix.hidden_states[-1][0, -1]
                errors["specdecpp_x"].append(hidden_error.abs().max())
                embed = target.get_input_embeddings().weight[sequences[row, i + 1]]
                assert torch.equal(data["adalength_x"][k, :64], embed)
                hidden_error = data["adalength_x"][k, 64:] - t_prefix.hidden_states[-1][0, -1]
                errors["adalength_x"].append(hidden_error.abs().max())
                run = 0  # drawn acceptances in a row up to i, at most max_length
                while run < 4 and run <= i and drawn_by_hand[row, i - run]:
                    run += 1
                assert data["adalength_history_sampling"][k].tolist() == [run / 4, float(run > 0)]
                assert data["specdecpp_y_greedy"][k].item() == float(p_i.argmax() == q_i.argmax())
                torch.testing.assert_close(data["specdecpp_y_sampling"][k], torch.minimum(p_i, q_i).sum(),
                                           atol=1e-5, rtol=0)
                top2 = q_i.sort(descending=True).values[:2]
                expected = torch.stack([top2[0].log(), -(q_i * q_i.log()).sum(), top2[0] - top2[1]])
                torch.testing.assert_close(data["specdecpp_x"][k, -3:], expected, atol=1e-4, rtol=1e-4)
                expected_count = accept[i + 1:i + 5].cumprod(0).sum()
                torch.testing.assert_close(data["adalength_y_sampling"][k], expected_count, atol=1e-4, rtol=0)
                before = 0  # argmax agreements in a row up to i, at most max_length
                while before < 4 and before <= i and agree[i - before]:
                    before += 1
                assert data["accepted_greedy"][k].item() == float(agree[i])
                assert data["adalength_history_greedy"][k].tolist() == [before / 4, float(before > 0)]
    # batched full forward vs the prefix's own: measured 6e-7 at most (float32 rounding)
    assert max(errors["specdecpp_x"]) < 2e-6 and max(errors["adalength_x"]) < 2e-6
    assert data["adalength_x"].shape == (2 * len(ends), 128)
    assert data["adalength_history_sampling"].shape == (2 * len(ends), 2)
    assert data["adalength_history_sampling"][:, 1].min() == 0 < data["adalength_history_sampling"][:, 0].max()
    drawn = data["accepted_sampling"]
    assert set(drawn.tolist()) == {0.0, 1.0} and abs(drawn.mean() - data["specdecpp_y_sampling"].mean()) < 0.15
    assert data["specdecpp_x"].shape == (2 * len(ends), 64 + 3)
    with pytest.raises(ValueError, match="sequences: need more than"):
        features_and_labels(target, draft, sequences[:, :12], start=10, max_length=4)


def test_simulated_tokens_per_ms_replays_rounds_by_hand():
    accept = torch.tensor([[True, True, False, True, True, True, False, False, True, True]])
    # max_length 3 (rows stop at j + 3 > 10). Fixed 2: root 0 keeps 2 (+1) -> root 3 keeps 2 -> root 6
    # keeps 0 -> root 7 keeps 0 -> root 8 would pass the end. 4 rounds, 3+3+1+1 = 8 tokens, cost 4*12
    runs = accepted_runs(accept.float(), 3)
    round_ms = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    rate, mean = simulated_tokens_per_ms(runs, torch.full((1, 10), 2), round_ms, 3)
    assert (rate, mean) == (pytest.approx(8 / 48), 2.0)
    # lengths by root: root 0 drafts 1 (keeps 1) -> root 2 drafts 3 (keeps 0) -> root 3 drafts 3 (keeps 3)
    # -> root 7 drafts 1 (keeps 0): 2+1+4+1 = 8 tokens, cost 11+13+13+11
    lengths = torch.tensor([[1, 5, 3, 3, 5, 5, 5, 1, 5, 5]])
    rate, mean = simulated_tokens_per_ms(runs, lengths, round_ms, 3)
    assert (rate, mean) == (pytest.approx(8 / 48), 2.0)
    rate, _ = simulated_tokens_per_ms(runs, lengths, [10.0, 20.0, 0.0, 30.0], 3)
    assert rate == pytest.approx(8 / 100)


def test_simulated_batch_tokens_per_ms_replays_a_batch_by_hand():
    accept = torch.tensor([[True, True, False, True, True, True, False, False, True, True],
                           [False, False, True, False, False, False, True, True, True, True]])
    # max_length 3, the batch drafts 2 per round. Row 0 as in the test above: roots 0, 3, 6, 7
    # (kept 2, 2, 0, 0). Row 1: roots 0, 1 (kept 0, 0), 2 (kept 1), 4, 5 (kept 0, 0), 6 (kept 2),
    # then root 9 is past the end. Rounds: 4 with both rows, 2 with row 1 alone.
    costs = []

    def round_ms(k, n):
        costs.append((k, n))
        return 10.0 * n + k

    rate, mean = simulated_batch_tokens_per_ms(accepted_runs(accept.float(), 3), lambda rows, roots: 2, round_ms, 3,
                                               batch=2)
    assert costs == [(2, 2)] * 4 + [(2, 1)] * 2
    assert (rate, mean) == (pytest.approx((8 + 9) / (4 * 22 + 2 * 12)), 2.0)
    # batch 1 is simulated_tokens_per_ms; the batch's choice sees its unfinished rows and their roots
    torch.manual_seed(0)
    accept, lengths = torch.rand(5, 40) < 0.6, torch.randint(1, 7, (5, 40))
    runs = accepted_runs(accept.float(), 6)
    round_cost = [10.0 + 1.5 * k for k in range(7)]
    assert simulated_batch_tokens_per_ms(runs, lambda rows, roots: int(lengths[rows, roots].max()),
                                         lambda k, n: round_cost[k], 6, batch=1) == \
        simulated_tokens_per_ms(runs, lengths, round_cost, 6)
    seen = []
    simulated_batch_tokens_per_ms(runs, lambda rows, roots: seen.append(rows.tolist()) or 3,
                                  lambda k, n: 1.0, 6, batch=2)
    assert seen[0] == [0, 1] and [4] in seen and all(len(r) <= 2 for r in seen)


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
    assert history["train"][-1] < history["train"][0] and history["held_out"] == []
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


def test_train_predictor_keeps_the_epoch_best_on_held_out_data():
    torch.manual_seed(0)
    x, held_x = torch.randn(256, 8), torch.randn(256, 8)
    y, held_y = torch.randint(0, 2, (256,)).float(), torch.randint(0, 2, (256,)).float()  # noise: it over-fits
    model = ResidualMLP(8, hidden=64)
    history = train_predictor(model, {0: (x, y)}, "bce", epochs=12, batch=32, progress=False,
                              held_out={0: (held_x, held_y)})
    assert len(history["held_out"]) == 12
    best = min(range(12), key=history["held_out"].__getitem__)
    assert history["best_epoch"] == best < 11
    with torch.no_grad():
        kept = torch.nn.functional.binary_cross_entropy_with_logits(model(held_x)[:, 0], held_y).item()
    assert kept == pytest.approx(history["held_out"][best], rel=1e-5)


def test_residual_mlp_forward_is_its_blocks_in_order():
    torch.manual_seed(0)
    model = ResidualMLP(11, out_features=3, hidden=16, depth=2)
    x = torch.randn(7, 11)
    h = model.inp(x)
    for block in model.blocks:
        h = h + block(h)
    torch.testing.assert_close(model(x), model.out(h), rtol=1e-6, atol=1e-6)


def test_predictor_file_round_trip(tmp_path):
    model = ResidualMLP(12, hidden=32, depth=1)
    model.save(tmp_path / "p.safetensors", kind="specdecpp", threshold=0.6, max_draft=7)
    loaded, settings = ResidualMLP.load(tmp_path / "p.safetensors")
    x = torch.randn(5, 12)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert settings == dict(kind="specdecpp", threshold=0.6, max_draft=7)
    policy = SpecDecPP(tmp_path / "p.safetensors")  # one tuned value serves every case
    assert set(policy.thresholds.values()) == {0.6} and policy.max_draft == 7
    model.save(tmp_path / "q.safetensors", kind="specdecpp", threshold=0.6, threshold_sampling=0.8,
               threshold_batch=0.4)
    # {(greedy, batched): threshold}; sampling batches take the batch-1 sampling value when not tuned
    assert SpecDecPP(tmp_path / "q.safetensors").thresholds == {(True, False): 0.6, (False, False): 0.8,
                                                                (True, True): 0.4, (False, True): 0.8}
    assert set(SpecDecPP(tmp_path / "q.safetensors", threshold=0.3).thresholds.values()) == {0.3}
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
    policy = SpecDecPP(constant(64 + 3, (logit, -5.0)), threshold=0.5, max_draft=12)
    out = spec_ext.generate(target, draft, [[5, 6, 7], [8, 9]], max_new_tokens=20, eos_token_id=[], policy=policy)
    assert set(out.stats.draft_lengths) == {4}
    out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=20, eos_token_id=[], policy=policy,
                            temperature=1.0, seed=0)  # sampling reads the second column: acceptance ~0.007
    assert set(out.stats.draft_lengths) == {1}


def test_specdecpp_stops_a_batch_by_its_mean_predicted_acceptance():
    # a head whose acceptance logit is the hidden state's first entry
    head = ResidualMLP(8 + 3, out_features=2, hidden=1, depth=0)
    with torch.no_grad():
        for t in head.parameters():
            t.zero_()
        head.inp.weight[0, 0] = 1.0
        head.out.weight.fill_(1.0)
    policy = SpecDecPP(head, threshold=0.5)

    class Draft:
        device = torch.device("cpu")
        config = type("Config", (), {"hidden_size": 8})

    plan = plan_of(policy, 2, greedy=True, draft=Draft())
    assert plan.stops
    hidden = torch.zeros(2, 8)
    hidden[:, 0] = torch.logit(torch.tensor([0.9, 0.3]))
    probs = torch.full((2, 5), 0.2)
    # step 1: mean(0.9, 0.3) = 0.6 >= 0.5, both go on (alone, the second row would stop)
    assert plan.keep_drafting(1, probs, probs.argmax(-1), hidden).tolist() == [True, True]
    # step 2: mean(0.81, 0.09) = 0.45 < 0.5, both stop (alone, the first row would go on)
    assert plan.keep_drafting(2, probs, probs.argmax(-1), hidden).tolist() == [False, False]


def test_adalength_drafts_the_predicted_length(pair):
    target, draft = pair
    policy = AdaLength(constant(128 + 2, (2.3, 0.2)), offset=0.0, max_draft=12)
    out = spec_ext.generate(target, draft, [[5, 6, 7], [8, 9]], max_new_tokens=20, eos_token_id=[], policy=policy)
    assert set(out.stats.draft_lengths) == {3}
    out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=20, eos_token_id=[], policy=policy,
                            temperature=1.0, seed=0)
    # the first round is verified in the prompt's own forward, before the target's hidden state at
    # its root is known: it drafts the policy's first guess (first_round), then the predictions
    assert out.stats.draft_lengths[0] == policy.first_round == 3 and set(out.stats.draft_lengths[1:]) == {1}
    with pytest.raises(ValueError, match="predictor: the AdaLength predictor takes 130 features but"):
        small = llama(97, 32, 1, seed=3)
        spec_ext.generate(small, small, [[5, 6]], policy=AdaLength(constant(130, (1, 1))))
    big = llama(97, 96, 1, seed=4)
    with pytest.raises(ValueError, match="predictor: the SpecDecPP predictor takes 64 features but"):
        spec_ext.generate(target, big, [[5, 6]], policy=SpecDecPP(constant(64, (1, 1))))


def test_batches_take_the_settings_tuned_for_batches(pair, tmp_path):
    target, draft = pair
    logit = torch.logit(torch.tensor(0.8)).item()
    # acceptance 0.8: threshold 0.5 drafts 4 (as above); 0.25 drafts 2 (1 - 0.8 <= 0.25 < 1 - 0.8^2)
    constant(64 + 3, (logit, logit)).save(tmp_path / "s.safetensors", kind="specdecpp", threshold=0.5,
                                          threshold_batch=0.25, max_draft=12)
    # predicted length 2.3: offset 0 drafts 3, offset -1 drafts 2
    constant(128 + 2, (2.3, 2.3)).save(tmp_path / "a.safetensors", kind="adalength", offset=0.0,
                                       offset_batch=-1.0, max_draft=12, first_round=3)
    for policy, alone, batched in ((SpecDecPP, 4, 2), (AdaLength, 3, 2)):
        out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=20, eos_token_id=[],
                                policy=policy(tmp_path / f"{policy.__name__[0].lower()}.safetensors"))
        assert set(out.stats.draft_lengths[:-1]) == {alone}
        out = spec_ext.generate(target, draft, [[5, 6, 7], [8, 9]], max_new_tokens=20, eos_token_id=[],
                                policy=policy(tmp_path / f"{policy.__name__[0].lower()}.safetensors"))
        assert out.stats.draft_lengths[2:4] == [batched, batched]  # the second round, both rows going


def test_adalength_reads_the_rows_history_of_accepted_drafts(pair):
    target, draft = pair
    head = ResidualMLP(128 + 2, out_features=2, hidden=1, depth=0)
    with torch.no_grad():  # predicted length = the history count + 0.5
        for t in head.parameters():
            t.zero_()
        head.inp.weight[0, 128] = 4.0  # history_features' first number is the count / 4
        head.out.weight.fill_(1.0)
        head.out.bias.fill_(0.5)
    prompt = [5, 6, 7]
    policy = AdaLength(head, offset=0.0, max_draft=6)
    out = spec_ext.generate(target, draft, [prompt], max_new_tokens=60, eos_token_id=[], policy=policy)
    drafted, accepted = out.stats.draft_lengths, out.stats.accepted_lengths
    # the history as the training data defines it: the run of positions where the draft's
    # greedy token (teacher-forced on the output) is the text's next one, ending just
    # before the root, counted from the prompt's last token on, at most 6
    sequence = out.sequences[0]
    with torch.inference_mode():
        agrees = (draft(sequence[None]).logits[0, :-1].argmax(-1) == sequence[1:]).tolist()
    root, expected = len(prompt) - 1, []
    for a in accepted:
        run = 0
        while run < 6 and root - 1 - run >= len(prompt) - 1 and agrees[root - 1 - run]:
            run += 1
        expected.append(min(6, run + 1))
        root += a + 1
    # the first round, verified in the prompt's own forward, drafts the policy's first guess (no target
    # hidden state at its root yet); the last may be cut to the tokens left
    assert drafted[0] == policy.first_round and drafted[1:-1] == expected[1:-1]
    assert max(drafted) > 2 and min(drafted) == 1
    # a round that accepted all its drafts but whose draft disagrees with the bonus resets it
    assert any(n == a and e == 1 for n, a, e in zip(drafted, accepted, expected[1:]))
    # a batch drafts to the mean of its rows' predictions: after row 0 accepted all 3 drafts
    # and agreed with the bonus (history 4) and row 1 none, 4.5 and 0.5 -> 2.5 -> 3 for both
    controller = AdaLength(head, offset=0.0, max_draft=6).start(Call(2, True, target, draft))
    first = controller.plan(RoundState(2))
    controller.observe(Report(first, [Source.MODEL] * 2, [3, 4], [3, 0], [[1, 2, 3, 4], [1]], 5))
    plan = controller.plan(RoundState(2, target_hidden=torch.randn(2, 64), roots=torch.tensor([5, 6])))
    assert plan.reads_agreement and plan.budget(torch.tensor([True, False])) == [3, 3]
    controller.keep_rows([1])
    assert controller.plan(RoundState(1)).budget() == [3]  # the kept row's length, before a prediction
    # row 1 alone: its history was reset (no accepted draft): 0 + 0.5 -> 1
    plan = controller.plan(RoundState(1, target_hidden=torch.randn(1, 64), roots=torch.tensor([6])))
    assert plan.budget(torch.tensor([False])) == [1]


def test_branch_classes():
    lengths = torch.tensor([0.0, 0.4, 1.0, 3.9, 4.0, 7.0])
    assert branch_classes(lengths, accept_all_length=4).tolist() == [0, 0, 1, 1, 2, 2]


def test_branch_predictor_steers_the_branches(pair):
    target, draft = pair
    drafted = {}
    for hint in (BranchHint.ACCEPT_ALL, BranchHint.REJECT_ALL):
        outputs = [0.0] * 6
        outputs[hint] = outputs[3 + hint] = 10.0
        policy = LearnedSpecBranch(branches=4, gamma=3, predictor=constant(128, tuple(outputs)))
        out = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=30, eos_token_id=[], policy=policy)
        assert out.sequences[0, 3:].tolist() == hf_greedy(target, [5, 6, 7], 30, eos=[])
        drafted[hint] = out.stats.drafted / out.stats.rounds
    chain = spec_ext.generate(target, draft, [[5, 6, 7]], max_new_tokens=30, eos_token_id=[], policy=PEARL(gamma=3))
    # BranchHint.REJECT_ALL forks every fresh root 4 ways; BranchHint.ACCEPT_ALL stops forking after the first verdict
    forked = drafted[BranchHint.REJECT_ALL]
    assert forked > drafted[BranchHint.ACCEPT_ALL] and forked > chain.stats.drafted / chain.stats.rounds
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
