"""Training EAGLE-3 heads (spec_ext.training.head): the unrolled training forward is the drafting
forward of inference step for step, the head starts as the target's last layer, training
learns and resumes to the same weights, and the head it saves decodes exactly."""
import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import spec_ext
from spec_ext.__main__ import main as cli
from spec_ext.models import SpecCache
from spec_ext.models.eagle import EagleHead, HeadConfig, _linear, load_head
from spec_ext.training import head as head_training
from spec_ext.training.corpus import frequent_tokens, prompts_from_files, tap_features
from spec_ext.training.head import HeadTraining, _losses, agreement, initial_head, train_head, unroll
from helpers import llama
from test_architectures import sharpened_model

WORDS = 40  # the tokenizer's words; with the end-of-text token the target's vocabulary is WORDS + 1


def word_tokenizer():
    vocab = {"<eos>": 0} | {f"w{i}": i + 1 for i in range(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def word_files(directory, count=3, seed=0):
    """Files of lines of words: a few phrases repeated with variations, so the target has
    something to continue."""
    rng = random.Random(seed)
    phrases = [[f"w{rng.randrange(WORDS)}" for _ in range(6)] for _ in range(8)]
    files = []
    for i in range(count):
        lines = [" ".join(rng.choice(phrases) + [f"w{rng.randrange(WORDS)}"]) for _ in range(300)]
        path = directory / f"text{i}.txt"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    return files


def cached_chain(head, embed, tokens, features, t, steps):
    """The drafting forward of inference (a cache, one step at a time): the pairs up to t,
    then ``steps - 1`` steps on the head's own outputs; each step's logits over the draft
    vocabulary."""
    cache = SpecCache(head.num_layers, None, None, 1, 64, torch.float32, "cpu")
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t
    logits, hidden = head(embed(tokens[:, 1:t + 2]), head.combine(features[:, :t + 1]), torch.arange(t + 1)[None],
                          cache)
    cache.advance([t + 1])
    out, hidden = [logits[0, t, draft_ids]], hidden[:, t:t + 1]
    for s in range(1, steps):
        logits, hidden = head(embed(tokens[:, t + 1 + s:t + 2 + s]), hidden, torch.tensor([[t + s]]), cache)
        cache.advance([1])
        out.append(logits[0, 0, draft_ids])
    return out


@pytest.mark.parametrize("family,layers", [("llama", 1), ("qwen3", 1), ("llama", 2), ("gpt2", 1), ("gemma2", 1)])
@pytest.mark.parametrize("norm_output,norm_before_residual", [(False, False), (True, True)])
@torch.no_grad()
def test_unrolled_training_forward_is_the_drafting_forward(family, layers, norm_output, norm_before_residual):
    target = sharpened_model(family)
    tokens = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    features, _ = tap_features(target, tokens, (0, 1, 2), path=None)
    head = initial_head(target, (0, 1, 2), frequent_tokens(tokens, 40, 61))
    if layers > 1:  # a deeper head: plain decoder layers after the first
        deeper = EagleHead(HeadConfig("eagle3", dict(head.config.layer, num_hidden_layers=layers),
                                      head.config.draft_vocab_size, (0, 1, 2), head.config.target_hidden_size))
        deeper.load_state_dict(head.state_dict(), strict=False)
        head = deeper
    head.config.norm_output, head.config.norm_before_residual = norm_output, norm_before_residual
    for p in head.parameters():  # away from the initialisation's zeros and identities
        p.add_(0.05 * torch.randn_like(p))
    embed, steps = target.get_input_embeddings(), 3
    outputs = unroll(head, embed, tokens, features.float(), steps)
    for row in range(2):
        for t in (0, 4, 8):
            chain = cached_chain(head, embed, tokens[row:row + 1], features[row:row + 1].float(), t, steps)
            for s in range(steps):
                torch.testing.assert_close(head.lm_head(outputs[s][row, t]), chain[s], atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_the_head_starts_as_the_targets_last_layer():
    target = sharpened_model("qwen3")
    draft_ids = torch.tensor([2, 5, 7, 30, 60])
    head = initial_head(target, (0, 1, 2), draft_ids)
    last, H = target.model.layers[-1], target.config.hidden_size
    assert torch.equal(head.d2t + torch.arange(5), draft_ids)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[draft_ids])
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    assert torch.equal(head.fc.weight, torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1))
    layer = head.layers[0]
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(layer.self_attn, name).weight[:, H:], getattr(last.self_attn, name).weight)
    assert torch.equal(layer.self_attn.q_norm.weight, last.self_attn.q_norm.weight)
    assert torch.equal(layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(layer.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(layer.post_attention_layernorm.weight, last.post_attention_layernorm.weight)


def test_frequent_tokens_by_count_then_id():
    sequences = torch.tensor([[3, 3, 1, 2, 2, 2, 0], [5, 5, 1, 4, 4, 0, 6]])
    # counts: 2 -> 3; 0, 1, 3, 4, 5 -> 2; 6 -> 1
    assert frequent_tokens(sequences, 3, 8).tolist() == [0, 1, 2]
    assert frequent_tokens(sequences, 4, 8).tolist() == [0, 1, 2, 3]


def test_prompts_end_at_line_breaks(tmp_path):
    tokenizer = word_tokenizer()
    files = word_files(tmp_path)
    prompts = prompts_from_files(tokenizer, files, 5, 20, seed=3)
    assert prompts == prompts_from_files(tokenizer, files, 5, 20, seed=3)
    text = "".join(f.read_text() for f in files)
    for ids in prompts:
        assert len(ids) == 20 and " ".join(f"w{i - 1}" for i in ids) in text.replace("\n", " ")
    with pytest.raises(ValueError, match="data"):
        prompts_from_files(tokenizer, files, 1, 20, min_chars=10 ** 7)


def small_settings(**overrides):
    settings = dict(sequences=24, validation_sequences=8, prompt_tokens=16, new_tokens=24, steps=40, batch=4,
                    ttt=2, lr=3e-3, warmup=5, draft_vocab=24, validate_every=20, checkpoint_every=10)
    return HeadTraining(**(settings | overrides))


def test_training_learns_resumes_and_decodes_exactly(tmp_path):
    target = llama(WORDS + 1, 32, 3, seed=0, sharpen=4.0)
    tokenizer, files = word_tokenizer(), word_files(tmp_path)
    head = train_head(target, tokenizer, files, tmp_path / "head", tmp_path / "work", small_settings(), log=lambda m: 0)
    history = __import__("json").loads((tmp_path / "head" / "training.json").read_text())["history"]
    assert [h["step"] for h in history] == [0, 20, 40]
    assert history[-1]["accepted_per_round"] > history[0]["accepted_per_round"] + 0.3
    assert history[-1]["first"] > 0.5

    class Interrupted(Exception):
        pass

    def stop_at_30(message):
        if message.startswith("step 30"):
            raise Interrupted

    settings = small_settings(validate_every=10)
    with pytest.raises(Interrupted):
        train_head(target, tokenizer, files, tmp_path / "resumed", tmp_path / "work2", settings, log=stop_at_30)
    resumed = train_head(target, tokenizer, files, tmp_path / "resumed", tmp_path / "work2", settings,
                         log=lambda m: 0)
    for (name, a), b in zip(head.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    loaded = load_head(tmp_path / "head")
    assert loaded.config.layer_ids == head.config.layer_ids
    prompts = prompts_from_files(tokenizer, files, 3, 12, seed=9)
    ids = torch.tensor(prompts)
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = spec_ext.generate(target, loaded, ids, max_new_tokens=20, policy="fixed")
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 10  # the trained head's drafts are taken: the test exercises acceptance
    with pytest.raises(ValueError, match="work"):
        train_head(target, tokenizer, files, tmp_path / "other", tmp_path / "work", small_settings(steps=41))


def test_agreement_counts_runs_of_agreeing_drafts():
    target = llama(WORDS + 1, 32, 2, seed=1, sharpen=4.0)
    tokens = torch.randint(1, WORDS + 1, (3, 20), generator=torch.Generator().manual_seed(0))
    features, last = tap_features(target, tokens, (0, 1, 2), path=None)
    head = initial_head(target, (0, 1, 2))
    result = agreement(head, target.get_input_embeddings(), target.get_output_embeddings(), (tokens, features, last),
                       steps=3)
    # the same runs counted by hand from the unrolled drafts
    with torch.no_grad():
        outputs = unroll(head, target.get_input_embeddings(), tokens, features.float(), 3)
        best = target.lm_head(last.float()).argmax(-1)
        runs = []
        for row in range(3):
            for t in range(20 - 1 - 3 + 1):
                run = 0
                while run < 3 and head.lm_head(outputs[run][row, t]).argmax() == best[row, t + 1 + run]:
                    run += 1
                runs.append(run)
    assert result["positions"] == len(runs)
    assert result["first"] == pytest.approx(sum(r >= 1 for r in runs) / len(runs))
    assert result["accepted_per_round"] == pytest.approx(sum(runs) / len(runs))


def test_gradients_pass_frozen_layers():
    """A frozen layer of a head being fine-tuned still carries the gradient to its input (the
    drafting kernel has no backward: it is taken only where no gradient is asked for)."""
    layer = torch.nn.Linear(8, 5).requires_grad_(False)
    x = torch.randn(3, 8, requires_grad=True)
    _linear(layer, x).square().sum().backward()
    expected = x.detach().requires_grad_()
    torch.nn.functional.linear(expected, layer.weight, layer.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)


def test_agreement_from_the_losses_per_step(monkeypatch):
    """first, conditional and accepted per round from hand-made agreements of 3 steps at 6
    roots (runs 0, 1, 2, 3, 3, 1), and the roots before from_position left out by _losses."""
    agree = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1]]).bool()[:, None]
    exists = torch.ones(3, 1, 6, dtype=torch.bool)
    monkeypatch.setattr(head_training, "_losses", lambda *args: (None, list(agree), exists))
    result = agreement(None, None, None, (torch.zeros(1, 8),) * 3, steps=3)
    assert result["positions"] == 6 and result["first"] == pytest.approx(5 / 6)
    assert result["conditional"] == pytest.approx([3 / 5, 2 / 3])
    assert result["accepted_per_round"] == pytest.approx((0 + 1 + 2 + 3 + 3 + 1) / 6)
    monkeypatch.undo()
    target = llama(WORDS + 1, 32, 2, seed=1)
    tokens = torch.randint(1, WORDS + 1, (2, 16), generator=torch.Generator().manual_seed(0))
    features, last = tap_features(target, tokens, (0, 1, 2), path=None)
    _, _, exists = _losses(initial_head(target, (0, 1, 2)), target.get_input_embeddings(),
                           target.get_output_embeddings(), (tokens, features, last), 3, from_position=5)
    assert not exists[:, :, :5].any() and exists[:, :, 5:16 - 1 - 2].all()


def test_train_head_refusals(tmp_path):
    target = llama(WORDS + 1, 32, 2, seed=0)
    tokenizer, files = word_tokenizer(), word_files(tmp_path)
    with pytest.raises(ValueError, match="layer_ids"):
        train_head(target, tokenizer, files, tmp_path / "h", tmp_path / "w", small_settings(layer_ids=(0, 5)))
    with pytest.raises(ValueError, match="data"):
        train_head(target, tokenizer, [], tmp_path / "h", tmp_path / "w", small_settings())
    with pytest.raises(ValueError, match="batch: 8 sequences per step, more than the 4"):
        train_head(target, tokenizer, files, tmp_path / "h", tmp_path / "w", small_settings(sequences=4, batch=8))
    with pytest.raises(ValueError, match="prompt_tokens: 5000 tokens"):
        prompts_from_files(tokenizer, files, 2, 5000)


def test_cli_names_the_bad_argument(tmp_path, capsys):
    target = tmp_path / "target"
    llama(WORDS + 1, 32, 2, seed=0).save_pretrained(target)
    with pytest.raises(SystemExit) as exit_:
        cli(["train-head", "--target", str(target), "--out", str(tmp_path / "h"), "--data", str(tmp_path / "nothing")])
    assert exit_.value.code == 2 and "--data: " in capsys.readouterr().err
    files = word_files(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli(["train-head", "--target", str(target), "--out", str(tmp_path / "h"), "--data", str(files[0]),
             "--validation-data", str(tmp_path / "nothing")])
    assert exit_.value.code == 2 and "--validation-data: " in capsys.readouterr().err
