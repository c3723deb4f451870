"""Feature heads (EAGLE-1 / EAGLE-3): random heads made here, written in the speculators
layout and the original EAGLE layouts by this test's own code, loaded back, and decoding
exactly: greedy equal to ``target.generate`` (lean forward and HF modules), sampling
following the target's exact law with a reduced draft vocabulary."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

import spec_ext
from spec_ext.drafters import HeadDrafter, Sampler
from spec_ext.models import aux_layer_ids
from spec_ext.models.eagle import EagleHead, HeadConfig, is_head_directory, load_head
from spec_ext.policies import Fixed
from helpers import (CollectingStreamer, PROMPT, VOCAB, assert_follows, eagle2_paths, exact_joint, llama,
                     ragged_greedy_equals_target, tree_paths)
from test_architectures import sharpened_model

V = 12  # a small vocabulary: random heads' drafts are accepted often enough to exercise the rollback
PROMPTS = [[5, 7, 3, 8, 11, 4], [9, 4, 10], [3, 1, 2, 3, 4, 5, 6, 7, 8]]


def random_head(target, kind="eagle3", draft_vocab=None, layer_ids=None, layers=1, seed=0, own_embeddings=False):
    """A random head for ``target``; ``draft_vocab`` < V: a random subset of the target's ids."""
    config = target.config.get_text_config()
    H = getattr(config, "hidden_size", None) or config.n_embd
    V = config.vocab_size
    layer = dict(model_type="llama", hidden_size=H, intermediate_size=2 * H, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=layers, vocab_size=V, rms_norm_eps=1e-6,
                 max_position_embeddings=256)
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig(kind, layer, draft_vocab or V, layer_ids), own_embeddings=own_embeddings)
    if draft_vocab and draft_vocab < V:
        kept = torch.randperm(V)[:draft_vocab].sort().values
        head.d2t.copy_(kept - torch.arange(draft_vocab))
    return head.eval()


@torch.no_grad()
def echo_head(target, kind="eagle3", draft_vocab=None, noise=0.0, seed=0):
    """A head that proposes what the target's last hidden state predicts (its own lm_head on
    the target's final features): from (x_n, feature_{n-1}) that is x_n again, so its drafts
    repeat the root and are accepted exactly where the target repeats itself (sharpened
    random targets fall into such loops), rejected elsewhere. ``noise``: perturbed weights."""
    L = target.config.get_text_config().num_hidden_layers
    head = random_head(target, kind, draft_vocab, layer_ids=(L, L, L) if kind == "eagle3" else None, seed=seed)
    H = head.hidden_size
    layer = head.layers[0]
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    head.fc.weight.zero_()
    if kind == "eagle3":
        head.fc.weight[:, :H] = torch.eye(H)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[torch.arange(head.d2t.shape[0]) + head.d2t])
    else:
        head.fc.weight[:, H:] = torch.eye(H)
    for p in head.parameters():
        p.add_(noise * torch.randn_like(p))
    return head


def draft_tokens(target, head, prompts=PROMPTS, k=3):
    """The drafts of the first round of every row (greedy, Fixed(k))."""
    seen = []

    class Recording(HeadDrafter):
        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            proposal = super().propose(seqs, roots, plan, forced, forced_rows)
            seen.append(proposal.tokens.tolist())
            return proposal

    spec_ext.generate(target, Recording(head), prompts, max_new_tokens=2, eos_token_id=[], policy=Fixed(k))
    return seen[0]


@pytest.fixture(scope="module")
def target():
    return llama(V, 32, 4, seed=3, sharpen=3.0)


# ---------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("model", ["llama", "qwen3", "gpt2"])
def test_greedy_equals_the_target_with_a_head(model, kind):
    """Ragged batch with EOS: llama and qwen3 on the lean forward, gpt2 on the HF modules;
    drafts are accepted and rejected along the way (the head's cache rolls back)."""
    target = llama(V, 32, 4, seed=3, sharpen=3.0) if model == "llama" else \
        sharpened_model(model, vocab=V, num_hidden_layers=4)
    head = echo_head(target, kind, draft_vocab=10 if kind == "eagle3" else None, noise=0.01)
    out = ragged_greedy_equals_target(target, head, PROMPTS, Fixed(3), max_new=24)
    assert out.stats.drafted > 0 and 0 < out.stats.accepted < out.stats.drafted, out.stats
    assert out.stats.draft_calls > 0


@pytest.mark.parametrize("shape", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_greedy_equals_the_target_with_a_head_growing_trees(model, kind, shape):
    from spec_ext.policies import DynamicTree, Tree
    target = llama(V, 32, 4, seed=3, sharpen=3.0) if model == "llama" else \
        sharpened_model(model, vocab=V, num_hidden_layers=4)
    head = echo_head(target, kind, draft_vocab=10 if kind == "eagle3" else None, noise=0.01)
    policy = DynamicTree(depth=3, top_k=3, nodes=8) if shape == "dynamic" else Tree((2, 2, 1))
    out = ragged_greedy_equals_target(target, head, PROMPTS + [[6]], policy, max_new=24)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats


@pytest.mark.parametrize("own_embeddings", [False, True])
@torch.no_grad()
def test_a_head_over_the_unpadded_vocabulary_drafts_for_a_padded_target(own_embeddings):
    """A target whose vocabulary is padded (V + 6 rows) and a head made for its V tokens: the
    drafts map into the target's ids, and tokens past the head's own embedding reach it as 0."""
    target = llama(V + 6, 32, 4, seed=7, sharpen=3.0)  # its text holds tokens past V (12, ...)
    head = echo_head(target, draft_vocab=10, noise=0.01)
    kept = torch.arange(10)  # draft ids below V
    head.d2t.zero_()
    head.lm_head.weight.copy_(target.get_output_embeddings().weight[kept])
    head.layer_config.vocab_size = V
    if own_embeddings:
        head.embed_tokens = torch.nn.Embedding(V, head.hidden_size)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight[:V])
    out = ragged_greedy_equals_target(target, head, PROMPTS, Fixed(3), max_new=24)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats


def test_one_token_prompts_and_every_length_policy(target):
    head = echo_head(target, draft_vocab=10, noise=0.01)
    for policy in ("auto", "fixed", "heuristic", "confidence", "svip"):
        ragged_greedy_equals_target(target, head, [[7], [5, 1, 3, 8], [11]], policy, max_new=16)


def test_streaming_and_the_accepted_lengths_of_every_round(target):
    head = echo_head(target, draft_vocab=10, noise=0.01)
    streamer = CollectingStreamer()
    fast = spec_ext.accelerate(target, head, policy="fixed")
    out = fast.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40, eos_token_id=[], streamer=streamer)
    assert streamer.ended and sum(streamer.chunks, []) == out[0].tolist()
    stats = fast.last_stats
    assert len(stats.accepted_lengths) == stats.rounds and sum(stats.accepted_lengths) == stats.accepted > 0


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("temperature,top_k,tree", [(1.0, None, None), (0.7, 4, None), (1.0, None, "dynamic"),
                                                     (0.7, 4, "dynamic"), (1.0, None, "static")])
def test_sampling_follows_the_target_with_a_reduced_draft_vocabulary(temperature, top_k, tree):
    """A draft vocabulary of 5 of the 8 tokens (q is 0 off it), chains and dynamic trees:
    the first 3 tokens' joint law is the target's, by enumeration."""
    from spec_ext.policies import DynamicTree, Tree
    target = llama(VOCAB, 32, 4, seed=10, sharpen=3.0)
    head = echo_head(target, draft_vocab=5, noise=0.05, seed=4)
    n = 20_000
    policy = {None: Fixed(2), "dynamic": DynamicTree(depth=2, top_k=3, nodes=6), "static": Tree((2, 1))}[tree]
    out = spec_ext.generate(target, head, [PROMPT] * n, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            eos_token_id=[], policy=policy, seed=7)
    assert out.stats.accepted > 0 and out.stats.accepted < out.stats.drafted
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(temperature, top_k)))


# ---------------------------------------------------------------------------- formats
def test_save_then_load_gives_the_same_drafts(target, tmp_path):
    for kind, vocab in (("eagle3", 8), ("eagle3", None), ("eagle", None)):
        head = random_head(target, kind, draft_vocab=vocab, layer_ids=(1, 2, 3) if kind == "eagle3" else None)
        head.save(tmp_path / kind)
        assert is_head_directory(tmp_path / kind)
        loaded = load_head(tmp_path / kind)
        assert draft_tokens(target, loaded) == draft_tokens(target, head)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["norm_before_residual"] is False and config["speculators_config"]["algorithm"] == "eagle3"


def test_the_original_eagle3_layout_loads(target, tmp_path):
    """midlayer.* weights, a plain Llama config with draft_vocab_size, no layer ids (the
    target's defaults, 2, L//2, L-3), t2d beside d2t."""
    head = random_head(target, draft_vocab=8)
    state = {k.replace("layers.0.", "midlayer."): v for k, v in head.state_dict().items()}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(8) + head.d2t] = True
    save_file({**state, "t2d": t2d}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(head.config.layer, architectures=["LlamaForCausalLM"],
                                                          draft_vocab_size=8)))
    loaded = load_head(tmp_path)
    assert loaded.config.layer_ids is None
    assert draft_tokens(target, loaded) == draft_tokens(target, head)
    drafter = HeadDrafter(loaded)
    drafter.bind(target)
    assert drafter.target_layers == aux_layer_ids(target) == (2, 2, 1)


def test_the_original_eagle1_layout_loads(target, tmp_path):
    """fc + layers.0.* without input norm, lm_head or final norm; config with a bias key."""
    head = random_head(target, "eagle")
    save_file({k: v for k, v in head.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(head.config.layer, bias=False)))
    assert is_head_directory(tmp_path)  # a plain Llama config, but fc and no lm_head in the weights
    loaded = load_head(tmp_path)
    assert loaded.config.kind == "eagle"
    assert draft_tokens(target, loaded) == draft_tokens(target, head)


def test_a_head_directory_is_a_draft_path(target, tmp_path):
    head = random_head(target, draft_vocab=8)
    head.save(tmp_path)
    by_path = spec_ext.generate(target, str(tmp_path), PROMPTS, max_new_tokens=8, eos_token_id=[], policy="fixed")
    by_object = spec_ext.generate(target, head, PROMPTS, max_new_tokens=8, eos_token_id=[], policy="fixed")
    assert torch.equal(by_path.sequences, by_object.sequences)
    assert by_path.stats.draft_calls == by_object.stats.draft_calls > 0


def test_the_layers_named_are_the_layers_tapped(target):
    """A head that names its layers reads exactly those (other layers give other drafts)."""
    named = random_head(target, layer_ids=(0, 1, 2))
    other = random_head(target, layer_ids=(1, 2, 3))
    other.load_state_dict(named.state_dict())
    drafter = HeadDrafter(named)
    drafter.bind(target)
    assert drafter.target_layers == (0, 1, 2)
    assert draft_tokens(target, named) != draft_tokens(target, other)


@pytest.mark.parametrize("change,field", [
    (dict(layer_ids=(1, 2, 9)), "eagle_aux_hidden_state_layer_ids"),
    (dict(hidden=48), "target_hidden_size"),
    (dict(vocab=V + 9), "d2t: the drafter drafts token ids outside the target's 12"),
])
def test_a_head_made_for_another_target_is_refused_by_name(target, change, field):
    head = random_head(target, layer_ids=change.get("layer_ids"))
    if "hidden" in change:
        head.config.target_hidden_size = change["hidden"]
    if "vocab" in change:  # a head over a larger vocabulary that drafts tokens the target does not have
        head.layer_config.vocab_size = change["vocab"]
        head.d2t[-1] = change["vocab"] - len(head.d2t)
    with pytest.raises(ValueError, match=field):
        spec_ext.generate(target, head, PROMPTS, max_new_tokens=4)


@pytest.mark.parametrize("policy,why", [
    (spec_ext.policies.PEARL(), "drafts while the target verifies"),
    (spec_ext.policies.SpecBranch(), "drafts while the target verifies"),
])
def test_policies_a_head_cannot_run_are_refused_saying_why(target, policy, why):
    with pytest.raises(ValueError, match=f"policy: {type(policy).__name__} .*{why}"):
        spec_ext.generate(target, random_head(target), PROMPTS, max_new_tokens=4, policy=policy)


@pytest.mark.parametrize("tree", [False, True])
def test_text_drafts_run_beside_a_head(target, tree):
    """NGram beside a head: rows whose text matches draft it, the others are drafted by the
    head, in the same round; greedy output equals the target's and both kinds of drafts are
    accepted. (Suffixes of 2 tokens at least: the echo head's drafts, the root repeated, are
    accepted where the target starts repeating a token, which a 1-token lookup would match.)"""
    head = echo_head(target, draft_vocab=10, noise=0.01)
    policy = spec_ext.policies.NGram(tree=tree, n_min=2, draft_k=3)
    out = ragged_greedy_equals_target(target, head, PROMPTS, policy, max_new=24)
    by_source = out.stats.by_source
    assert by_source["model"].accepted > 0 and by_source["text"].accepted > 0, out.stats.as_dict()
    assert out.stats.matched > 0 and out.stats.draft_calls > 0


def test_bad_head_files_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="speculators_model_type"):
        HeadConfig("medusa", dict(model_type="llama"), 10)
    with pytest.raises(ValueError, match="transformer_layer_config.model_type"):
        HeadConfig("eagle3", dict(model_type="gpt2"), 10)
    with pytest.raises(ValueError, match="norm_before_fc, fc_norm"):
        HeadConfig("eagle3", dict(model_type="llama"), 10, norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids: \\[3, 1, 2\\] is not ascending"):
        HeadConfig("eagle3", dict(model_type="llama"), 10, layer_ids=(3, 1, 2))
    with pytest.raises(ValueError, match="has no config.json"):
        load_head(tmp_path)


def test_a_speculators_config_without_norm_before_residual_reads_as_vllm_does(target, tmp_path):
    head = random_head(target)
    head.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_head(tmp_path).config.norm_before_residual is True  # vLLM's default for a missing key


def test_qwen2_layers_carry_their_projection_biases(target, tmp_path):
    head = random_head(target)
    layer = dict(head.config.layer, model_type="qwen2")
    qwen2 = EagleHead(HeadConfig("eagle3", layer, head.config.draft_vocab_size))
    assert qwen2.layers[0].self_attn.q_proj.bias is not None and qwen2.layers[0].self_attn.o_proj.bias is None
    qwen2.save(tmp_path)
    assert load_head(tmp_path).layers[0].self_attn.k_proj.bias is not None


def test_the_command_line_takes_a_head_as_its_draft(tmp_path):
    """``--draft`` loads a head directory as a head (the bundled target, a head saved here)."""
    from spec_ext.__main__ import load_pair
    from spec_ext.bundled import bundled_path
    target_dir = bundled_path("stdlib-target")
    _, target, _ = load_pair(target_dir, None)
    random_head(target, draft_vocab=64).save(tmp_path)
    _, target, head = load_pair(target_dir, tmp_path)
    assert isinstance(head, EagleHead) and head.config.draft_vocab_size == 64
    ids = [[5, 17, 33, 8]]
    out = spec_ext.generate(target, head, ids, max_new_tokens=8, eos_token_id=[], policy="fixed")
    expected = target.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.sequences.tolist() == expected.tolist()


def test_the_bundled_head_drafts_for_the_bundled_target():
    """models/stdlib-head (made by benchmarks/train_head.py) loads as a head and decodes the
    demo prompt exactly, most of its drafts accepted (over 48 tokens: the first round, which
    emits the first token from the prompt's forward, drafts nothing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from spec_ext.__main__ import DEMO_PROMPT
    from spec_ext.bundled import bundled_path
    from spec_ext.drafters import load
    target_dir = bundled_path("stdlib-target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = load(bundled_path("stdlib-head"), target)
    assert isinstance(head, EagleHead) and head.config.draft_vocab_size == 2048
    ids = AutoTokenizer.from_pretrained(target_dir)(DEMO_PROMPT, return_tensors="pt").input_ids
    out = spec_ext.generate(target, head, ids, max_new_tokens=48, eos_token_id=[], policy="fixed")
    expected = target.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None)
    assert torch.equal(out.sequences, expected)
    assert out.stats.acceptance_rate > 0.5, out.stats


@torch.no_grad()
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_the_heads_dynamic_tree_is_eagle2s_expansion_of_its_own_scores(target, kind):
    """The first tree (as token paths; after the first round, which emits the first token from
    the prompt's forward) equals EAGLE-2's expansion computed here from the head run one token
    at a time on a fresh cache over the committed text, with the target's features from HF's
    own output_hidden_states: the re-fed levels pair each node with its parent's output."""
    from spec_ext.models import SpecCache, attention_implementation
    from spec_ext.policies import DynamicTree
    head = random_head(target, kind, draft_vocab=10 if kind == "eagle3" else None, seed=5)
    policy = DynamicTree(depth=3, top_k=3, nodes=9)
    prompt = [5, 7, 3, 8, 11, 4]
    seen = []

    class Recording(HeadDrafter):
        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            proposal = super().propose(seqs, roots, plan, forced, forced_rows)
            seen.append((list(seqs[0]), proposal.tokens[0].tolist(), proposal.parents[0].tolist()))
            return proposal

    drafter = Recording(head)
    spec_ext.generate(target, drafter, [prompt], max_new_tokens=3, eos_token_id=[], policy=policy)
    text, tokens, parents = seen[0]  # the committed text the first tree grows after, its root last
    assert text[:len(prompt)] == prompt and len(text) > len(prompt)
    layers = drafter.target_layers
    states = target(torch.tensor([text]), output_hidden_states=True).hidden_states
    features = torch.cat([states[k][:, :-1] for k in layers], -1)  # the features of x_0 .. x_{n-2}

    def logp(path):
        cache = SpecCache(head.num_layers, None, None, 1, 64)
        with attention_implementation(target):
            embed = drafter.embed
            n = len(text) - 1
            logits, hidden = head(embed(torch.tensor([text[1:]])), head.combine(features), torch.arange(n)[None],
                                  cache, target_head=drafter.target_head)
            cache.advance([n])
            logits, hidden = logits[:, -1:], hidden[:, -1:]
            for i, token in enumerate(path):
                logits, hidden = head(embed(torch.tensor([[token]])), hidden, torch.tensor([[n + i]]), cache,
                                      target_head=drafter.target_head)
                cache.advance([1])
        return torch.log_softmax(logits[0, -1].float(), -1)

    assert tree_paths(tokens, parents) == eagle2_paths(logp, policy)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_a_head_skipped_for_plain_steps_drafts_what_a_fresh_head_on_the_committed_text_drafts(target, kind):
    """Five plain steps skip the head (their pairs wait in its store, appended in place, the
    store regrown, a one-token prompt's stand-in pair dropped); its next chain, per row of a
    ragged batch, equals the greedy chain of the head run here one token at a time on a fresh
    cache over that row's committed text, with the target's features from HF's own
    output_hidden_states."""
    from spec_ext.models import SpecCache, attention_implementation
    from spec_ext.policies import Controller, RoundPlan
    head = random_head(target, kind, seed=7)
    prompts = [[5, 7, 3, 8, 11, 4], [9]]
    seen = []

    class Recording(HeadDrafter):
        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            proposal = super().propose(seqs, roots, plan, forced, forced_rows)
            seen.append(([list(s) for s in seqs], proposal.tokens.tolist()))
            return proposal

    class SkipFive(Controller):
        rounds = 0

        def plan(self, state):
            self.rounds += 1
            return RoundPlan([0 if self.rounds <= 5 else 3] * state.rows)  # (after the first round: its own)

    @dataclasses.dataclass(frozen=True)
    class Skipping(Fixed):
        def start(self, call):
            return SkipFive(self, call)

    drafter = Recording(head)
    spec_ext.generate(target, drafter, prompts, max_new_tokens=9, eos_token_id=[], policy=Skipping(3))
    texts, chains = seen[0]
    assert all(len(t) == len(p) + 6 for t, p in zip(texts, prompts)), "the first chain follows six plain tokens"
    layers = drafter.target_layers
    for text, chain in zip(texts, chains):
        states = target(torch.tensor([text]), output_hidden_states=True).hidden_states
        features = torch.cat([states[k][:, :-1] for k in layers], -1)  # the features of x_0 .. x_{n-2}
        cache, n, expected = SpecCache(head.num_layers, None, None, 1, 64), len(text) - 1, []
        with attention_implementation(target):
            logits, hidden = head(drafter.embed(torch.tensor([text[1:]])), head.combine(features),
                                  torch.arange(n)[None], cache, target_head=drafter.target_head)
            cache.advance([n])
            for i in range(3):
                token = int(logits[0, -1].argmax())  # (the full vocabulary: draft ids are target ids)
                expected.append(token)
                logits, hidden = head(drafter.embed(torch.tensor([[token]])), hidden[:, -1:], torch.tensor([[n + i]]),
                                      cache, target_head=drafter.target_head)
                cache.advance([1])
        assert chain[:3] == expected, (text, chain, expected)


# ---------------------------------------------------------------------------- P-EAGLE
def parallel_head(target, draft_vocab=10, noise=0.01, seed=0):
    """An echo head (see :func:`echo_head`) made a P-EAGLE head: mask token V - 1 and a random
    learned mask feature, so its first draft is accepted where the target repeats itself and
    the masked slots draft from the mask feature."""
    head = echo_head(target, draft_vocab=draft_vocab, noise=noise, seed=seed)
    config = HeadConfig(head.config.kind, head.config.layer, head.config.draft_vocab_size, head.config.layer_ids,
                        mask_token_id=V - 1)
    parallel = EagleHead(config)
    parallel.load_state_dict(head.state_dict(), strict=False)
    with torch.no_grad():
        parallel.mask_hidden.normal_(0, 1.0, generator=torch.Generator().manual_seed(seed))
    return parallel.eval()


@pytest.mark.parametrize("policy", [Fixed(3), "tree", "dynamic"])
def test_greedy_equals_the_target_with_a_parallel_drafting_head(target, policy):
    from spec_ext.policies import DynamicTree, Tree
    policy = {"tree": Tree((2, 2, 1)), "dynamic": DynamicTree(depth=3, top_k=3, nodes=8)}.get(policy, policy)
    head = parallel_head(target)
    out = ragged_greedy_equals_target(target, head, PROMPTS + [[6]], policy, max_new=24)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats
    assert out.stats.draft_calls == out.stats.target_calls - 1  # one head forward per round


@torch.no_grad()
def test_a_parallel_heads_drafts_are_its_masked_slots_in_one_causal_forward(target):
    """The first chain (after the first round, which emits the first token from the prompt's
    forward) is the argmax of the head run here once over the committed text's pairs
    (x_{t+1}, feature_t) followed by k - 1 slots (mask token, fc(mask_hidden)) on a fresh cache."""
    from spec_ext.models import SpecCache, attention_implementation
    head = parallel_head(target, noise=0.2, seed=2)
    seen = []

    class Recording(HeadDrafter):
        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            proposal = super().propose(seqs, roots, plan, forced, forced_rows)
            seen.append((list(seqs[0]), proposal.tokens.tolist()))
            return proposal

    drafter = Recording(head)
    prompt = PROMPTS[0]
    spec_ext.generate(target, drafter, [prompt], max_new_tokens=3, eos_token_id=[], policy=Fixed(4))
    text, drafts = seen[0]  # the committed text the first chain drafts after, its root last
    assert text[:len(prompt)] == prompt and len(text) > len(prompt)
    states = target(torch.tensor([text]), output_hidden_states=True).hidden_states
    features = torch.cat([states[k][:, :-1] for k in drafter.target_layers], -1)
    n = len(text) - 1
    ids = torch.tensor([text[1:] + [V - 1] * 3])
    hidden = torch.cat([head.combine(features), head.combine(head.mask_hidden).expand(1, 3, -1)], 1)
    with attention_implementation(target):
        logits, _ = head(drafter.embed(ids), hidden, torch.arange(n + 3)[None], SpecCache(head.num_layers, None, None,
                                                                                         1, 64),
                         vocab_size=V)
    assert drafts == [logits[0, n - 1:].argmax(-1).tolist()]


def test_sampling_follows_the_target_with_a_parallel_drafting_head():
    target = llama(VOCAB, 32, 4, seed=10, sharpen=3.0)
    head = echo_head(target, draft_vocab=5, noise=0.05, seed=4)
    config = HeadConfig("eagle3", head.config.layer, 5, head.config.layer_ids, mask_token_id=VOCAB - 1)
    parallel = EagleHead(config)
    parallel.load_state_dict(head.state_dict(), strict=False)
    n = 12_000
    out = spec_ext.generate(target, parallel.eval(), [PROMPT] * n, max_new_tokens=3, temperature=0.7, top_k=4,
                            eos_token_id=[], policy=Fixed(2), seed=7)
    assert 0 < out.stats.accepted < out.stats.drafted
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(0.7, 4)))


def test_the_peagle_layout_round_trips_and_is_refused_by_field(target, tmp_path):
    head = parallel_head(target)
    head.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == V - 1
    loaded = load_head(tmp_path)
    assert loaded.config.mask_token_id == V - 1
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    assert draft_tokens(target, loaded) == draft_tokens(target, head)
    for change, field in ((dict(mask_token_id=None), "mask_token_id: a P-EAGLE head needs"),
                          (dict(mask_token_id=V + 2), "mask_token_id: 14 is not a token")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            load_head(tmp_path)
    with pytest.raises(ValueError, match="mask_token_id: only an EAGLE-3 head"):
        HeadConfig("eagle", dict(model_type="llama", vocab_size=V), V, mask_token_id=3)
