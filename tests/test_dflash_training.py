"""Training DFlash block drafters (spec_ext.training.dflash): slot j of the anchor at n learns
the token at n + j from features before n only, slots are weighted by the decay, training
lowers the held-out loss, resumes to the same weights, and what it saves loads through the
public loader and decodes exactly."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import spec_ext
from spec_ext.__main__ import main as cli
from spec_ext.models.dflash import load_dflash
from spec_ext.training.corpus import load_checkpoint, prompts_from_files, save_checkpoint, tap_features
from spec_ext.training.dflash import (DFlashTraining, block_losses, calibrate_to_target, default_layer_ids,
                                      draw_anchors, grown_dflash, initial_dflash, slot_positions, slot_weights,
                                      train_dflash, weighted_loss)
from helpers import llama
from test_head_training import WORDS, word_files, word_tokenizer


def small_settings(**overrides):
    settings = dict(sequences=24, validation_sequences=8, prompt_tokens=16, new_tokens=24, steps=40, batch=4,
                    anchors=8, block_size=4, lr=3e-3, warmup=5, draft_vocab=24, validate_every=20,
                    checkpoint_every=10)
    return DFlashTraining(**(settings | overrides))


def drafter_and_data(loss_seed=0, draft_vocab=None):
    """A tiny target, a drafter for it of block 5 and its data (tokens, features, last) of 2 rows."""
    target = llama(WORDS + 1, 32, 3, seed=loss_seed, sharpen=4.0)
    tokens = torch.randint(1, WORDS + 1, (2, 18), generator=torch.Generator().manual_seed(1))
    features, last = tap_features(target, tokens, (1, 2, 3), path=None)
    draft_ids = None if draft_vocab is None else torch.arange(1, draft_vocab + 1)
    draft = initial_dflash(target, (1, 2, 3), 1, 5, 0, draft_ids, seed=0)
    with torch.no_grad():  # away from the initialisation, so that every input matters
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target, draft, (tokens, features.float(), last.float())


def test_tapped_features_are_the_hidden_states_of_one_forward_over_all_rows(tmp_path):
    """Batches of 2 over 5 rows (the last batch ragged): the tapped features [N,T,A*H] and last
    hidden state equal HF's hidden_states of one forward over every row, rounded to bfloat16;
    cached, they read back the same; no rows at all is refused by name."""
    target = llama(WORDS + 1, 32, 3, seed=0)
    tokens = torch.randint(1, WORDS + 1, (5, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        states = target(tokens, output_hidden_states=True).hidden_states
    features, last = tap_features(target, tokens, (1, 3), path=tmp_path / "f.safetensors", batch=2)
    assert features.dtype == last.dtype == torch.bfloat16
    assert features.shape == (5, 9, 2 * states[1].shape[-1])
    torch.testing.assert_close(features.float(), torch.cat([states[1], states[3]], -1).bfloat16().float(),
                               atol=0, rtol=1e-2)
    torch.testing.assert_close(last.float(), states[-1].bfloat16().float(), atol=0, rtol=1e-2)
    again = tap_features(target, tokens[:0], (1, 3), path=tmp_path / "f.safetensors")
    assert torch.equal(again[0], features) and torch.equal(again[1], last)
    with pytest.raises(ValueError, match="sequences"):
        tap_features(target, tokens[:0], (1, 3), path=None)


def test_slot_j_of_the_anchor_at_n_learns_the_token_at_n_plus_j():
    positions, exists = slot_positions(torch.tensor([[3, 14, -1]]), 5, 16)
    assert positions[0, 0].tolist() == [4, 5, 6, 7]
    assert exists[0, 1].tolist() == [True, False, False, False] and not exists[0, 2].any()
    # the losses against ones written out: the drafter's slot logits, the text's token at n + j
    # (ce) or the target's own forward on the prefix up to n + j - 1 (kl)
    target, draft, (tokens, features, last) = drafter_and_data(draft_vocab=30)
    anchors = torch.tensor([[2, 7], [5, 12]])
    logits = draft.block_logits(features, tokens, anchors, target.get_input_embeddings().weight, None,
                                draft_vocab=True)
    ids = torch.arange(30) + draft.d2t
    ce, _, ce_exists = block_losses(draft, target, (tokens, features, last), anchors, "ce")
    kl, _, _ = block_losses(draft, target, (tokens, features, last), anchors, "kl")
    for row in range(2):
        for a in range(2):
            n = int(anchors[row, a])
            for j in range(1, 5):
                label = int(tokens[row, n + j])
                in_vocab = bool((ids == label).any())
                assert bool(ce_exists[row, a, j - 1]) == in_vocab
                if in_vocab:
                    expected = F.cross_entropy(logits[row, a, j - 1], (ids == label).nonzero()[0])
                    torch.testing.assert_close(ce[row, a, j - 1], expected)
                with torch.no_grad():
                    p = target(tokens[row:row + 1, :n + j]).logits[0, -1, ids].softmax(-1)
                expected = -(p * logits[row, a, j - 1].log_softmax(-1)).sum()
                torch.testing.assert_close(kl[row, a, j - 1], expected, rtol=1e-4, atol=1e-5)


def test_a_block_reads_the_features_before_its_anchor_only():
    target, draft, (tokens, features, last) = drafter_and_data()
    anchors = torch.tensor([[9], [9]])
    losses, _, _ = block_losses(draft, target, (tokens, features, last), anchors)
    later = features.clone()
    later[:, 9:] += torch.randn_like(later[:, 9:])  # the anchor's own feature and every one after it
    same, _, _ = block_losses(draft, target, (tokens, later, last), anchors)
    torch.testing.assert_close(same, losses, rtol=0, atol=0)
    before = features.clone()
    before[:, 8] += torch.randn_like(before[:, 8])  # the last feature before the anchor
    changed, _, _ = block_losses(draft, target, (tokens, before, last), anchors)
    assert (changed - losses).abs().min() > 1e-6  # every slot of every row reads it


def test_slot_weights_decay_with_the_slot():
    weights = slot_weights(16, 4.0)
    assert weights.shape == (15,) and weights[0] == 1.0
    torch.testing.assert_close(weights, torch.tensor([math.exp(-(j - 1) / 4.0) for j in range(1, 16)]))
    losses = torch.tensor([[[2.0, 4.0, 8.0]], [[1.0, 1.0, 1.0]]])
    exists = torch.tensor([[[True, True, True]], [[True, False, False]]])
    w = slot_weights(4, 2.0)
    expected = (2.0 * w[0] + 4.0 * w[1] + 8.0 * w[2] + 1.0 * w[0]) / 4
    torch.testing.assert_close(weighted_loss(losses, exists, w), expected)


def test_anchors_are_distinct_in_the_continuation_and_reproducible():
    anchors = draw_anchors(3, 40, 15, 8, torch.Generator().manual_seed(4))
    assert anchors.shape == (3, 8) and (anchors >= 15).all() and (anchors <= 38).all()
    assert all(len(set(row.tolist())) == 8 for row in anchors) and (anchors.diff(dim=-1) > 0).all()
    assert torch.equal(anchors, draw_anchors(3, 40, 15, 8, torch.Generator().manual_seed(4)))
    assert draw_anchors(1, 20, 15, 8, torch.Generator()).shape == (1, 4)  # every position there is
    assert default_layer_ids(8) == (2, 4, 6, 7) and default_layer_ids(3) == (2,)


@torch.no_grad()
def slot_one_attention(draft, features, tokens, n, embedding):
    """The first layer's attention [Hq, n + b] of slot 1 of the block anchored at ``n`` (keys:
    the context 0..n-1, then the block n..n+b-1), written out from the layer's modules."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half
    layer, b = draft.layers[0], draft.block_size
    attn, D = layer.self_attn, layer.self_attn.head_dim
    block = layer.input_layernorm(embedding[torch.tensor([int(tokens[n])] + [draft.config.mask_token_id] * (b - 1))])
    context = draft.project(features[:n])
    cos, sin = (t[0, 0] for t in draft.rope(torch.arange(n + b)[None], torch.float32, n + b))

    def heads(projection, norm, x, at):
        y = norm(projection(x).view(len(x), -1, D))
        return y * cos[at, None] + rotate_half(y) * sin[at, None]

    q = heads(attn.q_proj, attn.q_norm, block[1:2], torch.tensor([n + 1]))[0]  # [Hq,D]
    k = torch.cat([heads(attn.k_proj, attn.k_norm, context, torch.arange(n)),
                   heads(attn.k_proj, attn.k_norm, block, torch.arange(n, n + b))])
    k = k.repeat_interleave(q.shape[0] // k.shape[1], 1)  # [n+b,Hq,D]
    return (torch.einsum("hd,khd->hk", q, k) / D ** 0.5).softmax(-1)


def test_the_focused_initialisation_points_slot_one_at_the_context_it_predicts_from():
    """calibrate_to_target(focus=True) on the bundled target and source text: slot 1's queries
    (the mask token's) in the heads aimed at position n - 1 attend there more than the copied
    layer's queries do, or those only rescaled (focus=False), on rows the calibration did not
    see; a mask token with an all-zero embedding is refused by name."""
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from spec_ext.bundled import bundled_path
    target = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-target"), dtype=torch.float32).eval()
    text = (Path(spec_ext.__file__).parent / "reference.py").read_text()
    ids = AutoTokenizer.from_pretrained(bundled_path("stdlib-target"))(text).input_ids
    tokens = torch.tensor(ids[:6 * 40]).view(6, 40)
    layer_ids = (2, 4, 6, 7)
    features, _ = tap_features(target, tokens, layer_ids, path=None)
    features = features.float()
    embedding = target.get_input_embeddings().weight.detach().float()
    mask_token = int(tokens.max()) + 1  # a token of the vocabulary not in the text
    drafts = {}
    for init in ("copied", "calibrated", "focused"):
        draft = initial_dflash(target, layer_ids, 1, 8, mask_token, None, seed=0)
        if init != "copied":
            calibrate_to_target(draft, target, features[:4], tokens[:4], focus=init == "focused")
        drafts[init] = draft
    mass = {}
    anchors = (12, 25, 39)
    for init, draft in drafts.items():
        probs = [(slot_one_attention(draft, features[r], tokens[r], n, embedding), n) for r in (4, 5) for n in anchors]
        mass[init] = (sum(float(p[0::2, n - 1].mean()) for p, n in probs) / len(probs),  # context n - 1
                      sum(float(p[1::2, n].mean()) for p, n in probs) / len(probs))  # the anchor at n
    # measured: n - 1 gets 0.044 focused against 0.022 copied / 0.019 calibrated; the anchor's
    # share does not rise (0.053 against 0.067 / 0.078: the anchors' mean key is weak)
    assert mass["focused"][0] > 1.5 * max(mass["copied"][0], mass["calibrated"][0]), mass
    padded = target.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        target.get_input_embeddings().weight[mask_token] = 0.0  # a padding row
        with pytest.raises(ValueError, match=f"mask_token_id: token {mask_token}'s embedding is all zeros"):
            calibrate_to_target(initial_dflash(target, layer_ids, 1, 8, mask_token, None), target, features[:4],
                                tokens[:4])
        target.get_input_embeddings().weight.copy_(padded)


def test_training_learns_resumes_and_decodes_exactly(tmp_path):
    target = llama(WORDS + 1, 32, 3, seed=0, sharpen=4.0)
    tokenizer, files = word_tokenizer(), word_files(tmp_path)
    draft = train_dflash(target, tokenizer, files, tmp_path / "dflash", tmp_path / "work", small_settings(),
                         log=lambda m: 0)
    history = json.loads((tmp_path / "dflash" / "training.json").read_text())["history"]
    assert [h["step"] for h in history] == [0, 20, 40]
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    assert history[-1]["accepted_per_round"]["4"] > history[0]["accepted_per_round"]["4"] + 0.15

    class Interrupted(Exception):
        pass

    def stop_at_30(message):
        if message.startswith("step 30"):
            raise Interrupted

    settings = small_settings(validate_every=10)
    with pytest.raises(Interrupted):
        train_dflash(target, tokenizer, files, tmp_path / "resumed", tmp_path / "work2", settings, log=stop_at_30)
    resumed = train_dflash(target, tokenizer, files, tmp_path / "resumed", tmp_path / "work2", settings,
                           log=lambda m: 0)
    for (name, a), b in zip(draft.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    loaded = load_dflash(tmp_path / "dflash")
    assert loaded.config.layer_ids == draft.config.layer_ids and loaded.block_size == 4
    for (name, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.tensor(prompts_from_files(tokenizer, files, 3, 12, seed=9))
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = spec_ext.generate(target, str(tmp_path / "dflash"), ids, max_new_tokens=20, policy="fixed")
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 10  # the trained drafter's drafts are taken: the test exercises acceptance
    with pytest.raises(ValueError, match="work: .* other settings \\(steps\\)"):
        train_dflash(target, tokenizer, files, tmp_path / "other", tmp_path / "work", small_settings(steps=41))


def test_a_grown_drafter_computes_what_it_grew_from_and_its_added_layers_learn():
    target, draft, (tokens, features, _) = drafter_and_data(draft_vocab=20)
    anchors = torch.tensor([[3, 9, 14], [5, 6, 16]])
    embedding, output = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    grown = grown_dflash(draft, 3)
    assert grown.num_layers == 3 and grown.config.mask_token_id == draft.config.mask_token_id
    assert torch.equal(grown.d2t, draft.d2t)
    with torch.no_grad():
        before = draft.block_logits(features, tokens, anchors, embedding, output, draft_vocab=True)
        after = grown.block_logits(features, tokens, anchors, embedding, output, draft_vocab=True)
    assert torch.equal(before, after)
    logits = grown.block_logits(features, tokens, anchors, embedding, output, draft_vocab=True)
    logits.logsumexp(-1).sum().backward()
    for name in ("layers.1.self_attn.o_proj.weight", "layers.2.mlp.down_proj.weight"):  # the added layers' outputs
        assert grown.get_parameter(name).grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="layers: 0, fewer than the 1 layers"):
        grown_dflash(draft, 0)


def test_training_goes_on_from_a_saved_drafter_in_the_same_work_directory(tmp_path):
    target = llama(WORDS + 1, 32, 3, seed=0, sharpen=4.0)
    tokenizer, files = word_tokenizer(), word_files(tmp_path)
    first = train_dflash(target, tokenizer, files, tmp_path / "first", tmp_path / "work", small_settings(steps=20),
                         log=lambda m: 0)
    settings = small_settings(steps=30, lr=2e-3, layers=2, init_from=str(tmp_path / "first"))
    grown = train_dflash(target, tokenizer, files, tmp_path / "grown", tmp_path / "work", settings, log=lambda m: 0)
    first_run = json.loads((tmp_path / "first" / "training.json").read_text())
    grown_run = json.loads((tmp_path / "grown" / "training.json").read_text())
    before, history = first_run["history"], grown_run["history"]
    # the grown drafter's record keeps the run it came from
    assert first_run["earlier_runs"] == [] and grown_run["earlier_runs"] == [
        dict(settings=first_run["settings"], history=before)]
    # its step 0 is where the first run ended: the same function, the same held-out data
    assert history[0]["loss"] == pytest.approx(before[-1]["loss"], rel=1e-6)
    assert history[0]["accepted_per_round"] == before[-1]["accepted_per_round"]
    assert history[-1]["loss"] < history[0]["loss"] - 0.05
    assert grown.num_layers == 2 and torch.equal(grown.d2t, first.d2t)
    assert grown.config.mask_token_id == first.config.mask_token_id
    names = sorted(p.name for p in (tmp_path / "work").glob("dflash_checkpoint*"))
    assert len(names) == 2 and names[0] == "dflash_checkpoint.pt"
    assert names[1].startswith("dflash_checkpoint_from_first_")
    ids = torch.tensor(prompts_from_files(tokenizer, files, 2, 12, seed=9))
    expected = target.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = spec_ext.generate(target, str(tmp_path / "grown"), ids, max_new_tokens=16, policy="fixed")
    assert torch.equal(out.sequences, expected) and out.stats.accepted > 5
    messages = []  # the same settings again: resumed where it ended, the same drafter
    again = train_dflash(target, tokenizer, files, tmp_path / "again", tmp_path / "work", settings,
                         log=messages.append)
    assert "resumed at step 30" in messages
    for (name, a), b in zip(grown.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    other = llama(WORDS + 3, 32, 3, seed=0)  # another vocabulary
    for changed, message, model in (
            (dict(block_size=5), "block_size: 5, the drafter in init_from has 4", target),
            (dict(layer_ids=(1, 2)), "layer_ids: \\[1, 2\\], the drafter in init_from reads", target),
            (dict(draft_vocab=20), "draft_vocab: 20, the drafter in init_from has 24", target),
            (dict(layers=0), "layers: 0, fewer than the 1 layers", target),
            ({}, f"init_from: the drafter's vocabulary has {WORDS + 1} tokens, the target's {WORDS + 3}", other)):
        with pytest.raises(ValueError, match=message):
            train_dflash(model, tokenizer, files, tmp_path / "x", tmp_path / "fresh",
                         small_settings(init_from=str(tmp_path / "first"), **changed), log=lambda m: 0)
    assert not list((tmp_path / "fresh").iterdir()), "refused before any data was made"


def test_a_deadline_stops_training_validated_checkpointed_and_saved(tmp_path):
    target = llama(WORDS + 1, 32, 3, seed=0, sharpen=4.0)
    tokenizer, files = word_tokenizer(), word_files(tmp_path)
    messages = []
    draft = train_dflash(target, tokenizer, files, tmp_path / "dflash", tmp_path / "work", small_settings(),
                         log=messages.append, deadline=0.0)  # long past: the first step is the last
    history = json.loads((tmp_path / "dflash" / "training.json").read_text())["history"]
    assert [h["step"] for h in history] == [0, 1]
    state = load_checkpoint(tmp_path / "work" / "dflash_checkpoint.pt", dict(vars(small_settings())))
    assert state["step"] == 1 and any("stopped at step 1 of 40" in m for m in messages)
    for (name, a), b in zip(draft.state_dict().items(), load_dflash(tmp_path / "dflash").state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoints_are_replaced_whole(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, dict(steps=3), step=1)
    save_checkpoint(path, dict(steps=3), step=2)
    assert load_checkpoint(path, dict(steps=3))["step"] == 2 and not list(tmp_path.glob("*.partial"))
    assert load_checkpoint(tmp_path / "none.pt", dict(steps=3)) is None


def test_train_dflash_refusals(tmp_path):
    target = llama(WORDS + 1, 32, 2, seed=0)
    tokenizer, files = word_tokenizer(), word_files(tmp_path)
    for settings, message in ((small_settings(layer_ids=(0, 5)), "layer_ids"), (small_settings(loss="mse"), "loss"),
                              (small_settings(block_size=1), "block_size"), (small_settings(gamma=0.0), "gamma"),
                              (small_settings(sequences=4, batch=8), "batch: 8 sequences per step")):
        with pytest.raises(ValueError, match=message):
            train_dflash(target, tokenizer, files, tmp_path / "d", tmp_path / "w", settings)
    with pytest.raises(ValueError, match="data"):
        train_dflash(target, tokenizer, [], tmp_path / "d", tmp_path / "w", small_settings())


def test_cli_trains_and_names_the_bad_argument(tmp_path, capsys):
    target = tmp_path / "target"
    llama(WORDS + 1, 32, 2, seed=0).save_pretrained(target)
    word_tokenizer().save_pretrained(target)
    with pytest.raises(SystemExit) as exit_:
        cli(["train-dflash", "--target", str(target), "--out", str(tmp_path / "d"), "--data", str(tmp_path / "none")])
    assert exit_.value.code == 2 and "--data: " in capsys.readouterr().err
    files = word_files(tmp_path)
    cli(["train-dflash", "--target", str(target), "--out", str(tmp_path / "d"), "--data", *map(str, files),
         "--sequences", "8", "--prompt-tokens", "16", "--new-tokens", "12", "--steps", "2", "--batch", "4",
         "--anchors", "4", "--block-size", "4", "--threads", "1", "--draft-vocab", "20"])
    assert "saved the drafter" in capsys.readouterr().out
    assert load_dflash(tmp_path / "d").block_size == 4
    common = ["--target", str(target), "--data", *map(str, files), "--sequences", "8", "--prompt-tokens", "16",
              "--new-tokens", "12", "--steps", "2", "--batch", "4", "--anchors", "4", "--threads", "1"]
    cli(["train-dflash", *common, "--out", str(tmp_path / "d2"), "--init-from", str(tmp_path / "d"), "--layers", "2"])
    cli(["train-dflash", *common, "--out", str(tmp_path / "d3"), "--init-from", str(tmp_path / "d2")])
    assert load_dflash(tmp_path / "d2").num_layers == 2 and load_dflash(tmp_path / "d3").num_layers == 2
    d3 = load_dflash(tmp_path / "d3")  # the defaults are the drafter's
    assert d3.config.draft_vocab_size == 20 and d3.block_size == 4
