"""DFlash block drafters (spec_ext.models.dflash, spec_ext.drafters.block): the cached block
forward against a reference written out here from the raw weights, the slots and features
aligned as the format defines them, decoding exact (greedy equal to ``target.generate``,
sampling following the target's law by enumeration), the drafter's state after every round
equal to a fresh drafter's on the committed text, the speculators and z-lab layouts, and
refusals by field. A drafter trained here for a few hundred steps on the tiny target's own
greedy continuations (through ``block_logits``, the training forward) is accepted often, so
the exactness tests see accepted and rejected drafts."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import spec_ext
from spec_ext.drafters import BlockDrafter, Sampler
from spec_ext.models import hf_modules, num_layers
from spec_ext.models.dflash import DFlashConfig, DFlashDraft, is_dflash_directory, load_dflash
from spec_ext.policies import Auto, DynamicTree, Fixed, Tree
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, llama, ragged_greedy_equals_target
from test_architectures import sharpened_model

V = 12
PROMPTS = [[5, 7, 3, 8, 11, 4], [9, 4, 10], [3, 1, 2, 3, 4, 5, 6, 7, 8]]


def layer_config(H, V, layers=1, **extra):
    return dict(model_type="qwen3", hidden_size=H, intermediate_size=2 * H, num_attention_heads=4,
                num_key_value_heads=2, head_dim=H // 4, num_hidden_layers=layers, vocab_size=V, rms_norm_eps=1e-6,
                max_position_embeddings=256, **extra)


def random_dflash(target, block=4, layer_ids=None, draft_vocab=None, layers=1, seed=0, scale=None, **config):
    """A random DFlash drafter for ``target`` (mask id V - 1; ``draft_vocab`` < V: a random
    subset of the target's ids; ``scale``: weights drawn at that std, for visible attention)."""
    text = target.config.get_text_config()
    H = getattr(text, "hidden_size", None) or text.n_embd
    L = num_layers(target)
    extra = {k: config.pop(k) for k in ("layer_types", "sliding_window", "use_sliding_window") if k in config}
    torch.manual_seed(seed)
    draft = DFlashDraft(DFlashConfig(layer_config(H, text.vocab_size, layers, **extra), block,
                                     layer_ids or (1, L // 2, L), text.vocab_size - 1, draft_vocab, **config))
    with torch.no_grad():
        if scale is not None:
            for p in draft.parameters():
                p.normal_(0, scale)
        if draft.reduced:
            kept = torch.randperm(text.vocab_size)[:draft_vocab].sort().values
            draft.d2t.copy_(kept - torch.arange(draft_vocab))
    return draft.eval()


def hf_features(target, sequence, layer_ids):
    """HF's own hidden states ``layer_ids`` of ``sequence``, concatenated [1,S,F]."""
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    return torch.cat([states[k] for k in layer_ids], -1)


def train(target, draft, steps=200, rows=48, length=40, seed=0):
    """Fit ``draft`` to the target's greedy next tokens on its own greedy continuations of
    random prompts: random anchors, cross-entropy of each slot, through ``block_logits``."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (rows, 4), generator=g)
    with torch.no_grad():
        seqs = target.generate(prompts, max_new_tokens=length - 4, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        out = target(seqs, output_hidden_states=True)
    features = torch.cat([out.hidden_states[k] for k in draft.config.layer_ids], -1)
    labels = out.logits.argmax(-1)  # labels[t]: the target's token at t + 1
    embedding = target.get_input_embeddings().weight.detach()
    output = target.get_output_embeddings().weight.detach()
    b, batch, per_row = draft.block_size, 16, 8
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    draft.train()
    for _ in range(steps):
        picked = torch.randint(0, rows, (batch,), generator=g)
        anchors = torch.randint(1, length - b, (batch, per_row), generator=g)
        logits = draft.block_logits(features[picked], seqs[picked], anchors, embedding, output)
        wanted = labels[picked][torch.arange(batch)[:, None, None], anchors[..., None] + torch.arange(b - 1)]
        loss = F.cross_entropy(logits.flatten(0, 2), wanted.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="module")
def target():
    return llama(V, 32, 4, seed=3, sharpen=3.0)


@pytest.fixture(scope="module")
def trained(target):
    return train(target, random_dflash(target, block=4))


# ---------------------------------------------------------------------- the forward
def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def written_out_block(draft, features, anchor, embedding, output):
    """Logits [K,V] of one block from the raw weights: queries [anchor, mask x (b-1)] at
    positions n..n+b-1 (n = len(features), the features of positions 0..n-1); keys the
    context (hidden_norm(fc(features)), each layer's k_proj, k_norm, rope at its position)
    then the block; every context position and every block slot visible (sliding layers:
    the context within the window of the anchor, the block causal unless non-causal)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half
    config, c = draft.layer_config, draft.config
    n, b, D = features.shape[0], c.block_size, config.head_dim
    sd = {k: v.float() for k, v in draft.state_dict().items()}
    context = rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    tokens = torch.tensor([anchor] + [c.mask_token_id] * (b - 1))
    x = embedding[tokens]
    cos, sin = Qwen3RotaryEmbedding(config)(x, torch.arange(n + b)[None])
    cos, sin = cos[0], sin[0]  # [n+b, D]
    types = c.layer.get("layer_types") or ["full_attention"] * config.num_hidden_layers
    for i in range(config.num_hidden_layers):
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])

        def heads(y, name, norm):
            y = (y @ w[f"self_attn.{name}.weight"].T).view(y.shape[0], -1, D)
            return rms(y, w[f"self_attn.{norm}.weight"]) if norm else y

        def rotate(y, at):
            return y * cos[at, None] + rotate_half(y) * sin[at, None]

        q = rotate(heads(h, "q_proj", "q_norm"), torch.arange(n, n + b))
        k = torch.cat([rotate(heads(context, "k_proj", "k_norm"), torch.arange(n)),
                       rotate(heads(h, "k_proj", "k_norm"), torch.arange(n, n + b))])
        v = torch.cat([heads(context, "v_proj", None), heads(h, "v_proj", None)])
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
        seen = torch.ones(b, n + b, dtype=torch.bool)
        if types[i] == "sliding_attention" and config.sliding_window is not None:
            seen[:, :n] = n - torch.arange(n) <= config.sliding_window
            if not c.sliding_window_non_causal:
                seen[:, n:] = torch.ones(b, b).tril().bool()
        attended = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)
        x = x + attended.flatten(1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    head = sd["lm_head.weight"] if draft.lm_head is not None else output
    logits = rms(x, sd["norm.weight"]) @ head.T
    return logits[c.first_slot:]


@pytest.mark.parametrize("variant", ["full", "sliding", "sliding_non_causal", "sliding_last", "sample_from_anchor"])
@torch.no_grad()
def test_the_cached_block_forward_equals_the_written_out_block(target, variant):
    """A ragged batch whose context is cached in pieces (as the rounds extend it) and a block
    per row; and block_logits with several anchors per row: both equal the block written out
    from the raw weights, which sees only the context before the anchor and its own block."""
    from spec_ext.models import SpecCache
    options = dict(layers=2, seed=1, scale=0.3)
    if variant.startswith("sliding"):  # the last layer sliding too: the slots a round cuts to read its mask rows
        types = ["full_attention", "sliding_attention"] if variant == "sliding_last" else \
            ["sliding_attention", "full_attention"]
        options.update(layer_types=types, sliding_window=3, use_sliding_window=True,
                       sliding_window_non_causal=variant == "sliding_non_causal")
    if variant == "sample_from_anchor":
        options["sample_from_anchor"] = True
    draft = random_dflash(target, block=5, **options)
    embedding, output = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    torch.manual_seed(0)
    sequences = [torch.randint(0, V, (s,)) for s in (9, 4, 12)]
    features = [hf_features(target, s.tolist(), draft.config.layer_ids)[0] for s in sequences]
    cache = SpecCache(draft.num_layers, None, None, 3, 32)
    contexts = [f[:-1] for f in features]  # anchors: each sequence's last token
    for piece in (slice(0, 2), slice(2, 7), slice(7, None)):
        parts = [c[piece] for c in contexts]
        width = max(len(p) for p in parts)
        padded = torch.stack([F.pad(p, (0, 0, 0, width - len(p))) for p in parts])
        draft.extend(draft.project(padded), cache, [len(p) for p in parts])
    assert cache.host_lengths == [len(s) - 1 for s in sequences]
    anchors = torch.stack([s[-1] for s in sequences])
    embeds = draft.embed(draft.block_tokens(anchors), embedding)
    cached = draft.logits(draft(embeds, cache)[:, draft.config.first_slot:], output)
    for slots in range(1, draft.config.num_drafts + 1):  # the last layer querying the first slots alone
        torch.testing.assert_close(draft.logits(draft(embeds, cache, slots), output), cached[:, :slots],
                                   rtol=1e-5, atol=1e-5)
    width = max(len(s) for s in sequences)
    whole = draft.block_logits(torch.stack([F.pad(f, (0, 0, 0, width - len(f))) for f in features]),
                               torch.stack([F.pad(s, (0, width - len(s))) for s in sequences]),
                               torch.tensor([[len(s) - 1, 2, 1] for s in sequences]), embedding, output)
    for row, s in enumerate(sequences):
        expected = written_out_block(draft, features[row][:-1], int(s[-1]), embedding, output)
        torch.testing.assert_close(cached[row], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(whole[row, 0], expected, rtol=1e-4, atol=1e-4)
        for a, n in ((1, 2), (2, 1)):  # other anchors of the same row see only their own context
            torch.testing.assert_close(whole[row, a], written_out_block(draft, features[row][:n], int(s[n]),
                                                                        embedding, output), rtol=1e-4, atol=1e-4)


def recording(draft):
    """A BlockDrafter that keeps each round's committed rows and its block's logits."""
    rounds = []

    class Recording(BlockDrafter):
        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            self._seqs = [list(s) for s in seqs]
            return super().propose(seqs, roots, plan, forced, forced_rows)

        def block(self, roots, slots=None):
            logits, hidden = super().block(roots, slots)
            rounds.append((self._seqs, roots.tolist(), logits.clone()))
            return logits, hidden

    return Recording(draft), rounds


def recording_auto(chosen, offers_nothing=lambda round: False, explore_share=Auto.EXPLORE_SHARE, taken=None):
    """Auto whose controller appends to ``chosen`` the longest model chain each round's plan
    drafts (0: the model drafts no row) and to ``taken`` (where given) the target forwards each
    plan took (a plain run's steps); in the rounds where ``offers_nothing(round)`` (counted
    from 0) the rows' text offers no match; ``explore_share``: Auto's ``EXPLORE_SHARE``."""

    from test_policies import Text  # (a TextLookup of given chain lengths: here none anywhere)

    class Recording(Auto):
        EXPLORE_SHARE = explore_share

        def start(self, call):
            controller = super().start(call)
            plan = controller.plan

            def recorded(state):
                if state.text is not None and offers_nothing(len(chosen)):
                    state = dataclasses.replace(state, text=Text([0] * state.rows))
                decided = plan(state)
                chosen.append(max(decided.k) if decided.tree is None else decided.tree.max_depth)
                return decided
            controller.plan = recorded
            if taken is not None:
                observe = controller.observe
                controller.observe = lambda report: taken.append(report.steps) or observe(report)
            return controller
    return Recording()


@torch.no_grad()
def test_the_first_drafts_are_the_slots_of_the_block_on_hf_features(target, trained):
    """Slot j of the block anchored at the root predicts the token after j - 1 drafts: the
    first block's drafts (after the first round, which emits the first token from the prompt's
    forward) are the argmax of the written-out block on HF's features of the committed text's
    positions before the root (a drafter fed the root's own feature, or one whose drafts are
    its slots shifted by one, fails here), and the trained drafter is accepted most of the
    time (which slots shifted by one would not be)."""
    drafter, rounds = recording(trained)
    out = spec_ext.generate(target, drafter, PROMPTS, max_new_tokens=24, eos_token_id=[], policy=Fixed(2))
    seqs, roots, logits = rounds[0]
    assert logits.shape[1] == 2 < trained.config.num_drafts  # the slots drafted from, no more
    embedding, output = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    for row, (prompt, seq) in enumerate(zip(PROMPTS, seqs)):
        assert seq[:len(prompt)] == prompt and len(seq) > len(prompt) and roots[row] == seq[-1]
        features = hf_features(target, seq, trained.config.layer_ids)[0, :-1]
        expected = written_out_block(trained, features, seq[-1], embedding, output)
        torch.testing.assert_close(logits[row], expected[:2], rtol=1e-4, atol=1e-4)
        assert out.sequences.shape[1] > len(prompt)
    assert out.stats.accepted > 0.5 * out.stats.drafted, out.stats


@pytest.mark.parametrize("policy", [Fixed(3), Tree((2, 2, 1)), DynamicTree(depth=3, top_k=3, nodes=8), Fixed(2),
                                    Tree((2, 1))], ids=["chain", "static", "dynamic", "short_chain", "shallow"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_after_every_round_the_block_equals_a_fresh_drafters_on_the_committed_text(target, trained, policy,
                                                                                  temperature):
    """Draft fidelity: each round's block logits equal those of a new drafter started on the
    committed text alone (its features from HF's forward), over rounds that accepted all,
    some and none of their drafts, chains and trees, greedy and sampled; a short chain or a
    shallow tree computes the slots it drafts from, which equal the fresh block's first."""
    drafter, rounds = recording(trained)
    out = spec_ext.generate(target, drafter, PROMPTS, max_new_tokens=20, eos_token_id=[], temperature=temperature,
                            seed=3, policy=policy)
    lengths = out.stats.accepted_lengths
    assert min(lengths) == 0 and 0 < out.stats.accepted < out.stats.drafted, lengths
    for seqs, roots, logits in rounds[1:]:
        for row, seq in enumerate(seqs):
            fresh = BlockDrafter(trained)
            fresh.bind(target)
            fresh.start([seq], 64, Sampler(), features=hf_features(target, seq, trained.config.layer_ids)[:, :-1])
            expected, _ = fresh.block(torch.tensor([seq[-1]]))  # every slot; a round computes those it drafts
            assert roots[row] == seq[-1]
            torch.testing.assert_close(logits[row], expected[0, :logits.shape[1]], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_after_rounds_where_only_the_text_drafted_the_block_equals_a_fresh_drafters(target, trained):
    """Draft fidelity beside the text (Auto, the default): in a round where only the rows' own
    text drafts no block runs, and the next block still equals a fresh drafter's on the
    committed text (its context grew in commit whatever was drafted)."""
    chosen = []
    # every other round the text offers nothing, so the model drafts again (where plain steps
    # win on this machine's clock, in rounds that explore: one every few plain steps)
    alternating = recording_auto(chosen, offers_nothing=lambda round: round % 2, explore_share=0.5)
    block, rounds = recording(trained)
    out = spec_ext.generate(target, block, PROMPTS, max_new_tokens=40, eos_token_id=[], policy=alternating)
    for row, prompt in enumerate(PROMPTS):
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert out.sequences[row, -40:].tolist() == expected[0, -40:].tolist()
    skipped = [n for n, k in enumerate(chosen) if k == 0]
    assert skipped and any(k > 0 for k in chosen[skipped[0]:]), chosen  # blocks after a round without one
    assert len(rounds) == sum(k > 0 for k in chosen)
    for seqs, roots, logits in rounds:
        for row, seq in enumerate(seqs):
            fresh = BlockDrafter(trained)
            fresh.bind(target)
            fresh.start([seq], 64, Sampler(), features=hf_features(target, seq, trained.config.layer_ids)[:, :-1])
            expected, _ = fresh.block(torch.tensor([seq[-1]]))
            assert roots[row] == seq[-1]
            torch.testing.assert_close(logits[row], expected[0, :logits.shape[1]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slope, longest", [(0.4, 1), (0.0, 3)])
@torch.no_grad()
def test_auto_sampling_drafts_the_block_its_priced_verification_pays(target, trained, monkeypatch, slope, longest):
    """Sampling, Auto prices a round by the target's verification by width as timed once per
    process (here given: 1 + slope (w - 1) steps) and a block forward at the drafter's share
    of the parameters: a steep verification (each token 0.4 of a step) keeps the block to one
    draft (from 0.45 on, plain steps beat it), a flat one drafts the whole block (a flat price everywhere drafted every slot on a CPU, where that is
    slower than the target alone); each round's block computes the slots it drafts."""
    from spec_ext.policies import Auto, Costs
    costs = Costs()
    for w in range(1, 40):
        costs.record_verify(len(PROMPTS), w, 1.0 + slope * (w - 1))
    monkeypatch.setattr("spec_ext.policies.estimates.round_costs", lambda call, schedule, sequential: costs)
    drafter, rounds = recording(trained)
    spec_ext.generate(target, drafter, PROMPTS, max_new_tokens=12, eos_token_id=[], temperature=1.0, seed=0,
                      policy=Auto(text=False))
    slots = [logits.shape[1] for _, _, logits in rounds]  # every eighth round explores one more or one fewer
    assert max(set(slots), key=slots.count) == longest and max(slots) <= longest + 1, slots


# ---------------------------------------------------------------------- exact decoding
@pytest.mark.parametrize("path", ["lean", "hf"])
@pytest.mark.parametrize("policy", [Fixed(3), Tree((2, 2, 1)), DynamicTree(depth=3, top_k=3, nodes=8), "auto"],
                         ids=["chain", "static", "dynamic", "auto"])
def test_greedy_equals_the_target_with_a_block_drafter(target, trained, policy, path):
    """Ragged batch with EOS and a one-token prompt, on the lean forward and the HF modules.
    One block forward per round where the model drafts; none in Auto's rounds where only the
    rows' own text does (the block's context grows in commit whatever was drafted)."""
    prompts = PROMPTS + [[6]]
    chosen, taken = [], []
    if policy == "auto":
        policy = recording_auto(chosen, taken=taken)
    if path == "hf":
        with hf_modules(target):
            out = ragged_greedy_equals_target(target, trained, prompts, policy, max_new=24)
    else:
        out = ragged_greedy_equals_target(target, trained, prompts, policy, max_new=24)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats
    rounds = out.stats.target_calls - 1  # (the prefill)
    assert out.stats.draft_calls == (sum(k > 0 for k in chosen) if chosen else rounds)
    assert not chosen or (len(chosen) == len(taken) and sum(taken) == rounds)


def test_the_bundled_drafter_drafts_for_the_bundled_target():
    """models/stdlib-dflash (benchmarks/train_dflash.py) loads for the bundled target, decodes
    the demo prompt exactly through accelerate() (Auto, the default) and Fixed(3), and more
    than one of a block-4 round's drafts is accepted per round."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from spec_ext.__main__ import DEMO_PROMPT
    from spec_ext.bundled import bundled_path
    target_dir = bundled_path("stdlib-target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_dflash(bundled_path("stdlib-dflash"))
    assert drafter.block_size == 16 and drafter.config.draft_vocab_size == 2048
    ids = AutoTokenizer.from_pretrained(target_dir)(DEMO_PROMPT, return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None)
    out = spec_ext.generate(target, bundled_path("stdlib-dflash"), ids, max_new_tokens=48, eos_token_id=[],
                            policy=Fixed(3))
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted / out.stats.rounds > 1.0, out.stats
    fast = spec_ext.accelerate(target, str(bundled_path("stdlib-dflash")))
    assert torch.equal(fast.generate(ids, max_new_tokens=48, eos_token_id=[]), expected)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gpt2"])
def test_greedy_equals_the_target_on_every_architecture(kind):
    """Random drafters (layer ids 0, L//2, L) for each target: lean (llama, qwen3) and HF
    modules (gemma2: soft-caps and sliding windows; gpt2), and each kept on the HF modules."""
    target = sharpened_model(kind, vocab=V, **(dict(n_layer=4) if kind == "gpt2" else dict(num_hidden_layers=4)))
    draft = random_dflash(target, block=4, layer_ids=(0, 2, 4), draft_vocab=10)
    ragged_greedy_equals_target(target, draft, PROMPTS, Fixed(3), max_new=16)
    with hf_modules(target):
        ragged_greedy_equals_target(target, draft, PROMPTS, Tree((2, 1)), max_new=16)


def test_greedy_with_logits_processors_equals_the_targets(target, trained):
    """HF's repetition penalty and no-repeat n-grams on every slot (each slot processed after
    the drafts before it) and on the verification: the output is HF's."""
    settings = dict(repetition_penalty=1.5, no_repeat_ngram_size=3)
    for policy in (Fixed(3), Tree((2, 2, 1))):
        out = spec_ext.generate(target, trained, [PROMPTS[0]], max_new_tokens=20, eos_token_id=[], policy=policy,
                                **settings)
        expected = target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, **settings)
        assert out.sequences.tolist() == expected.tolist()
        assert out.stats.accepted > 0


@pytest.mark.parametrize("temperature,top_k,shape", [(1.0, None, "chain"), (0.7, 4, "chain"), (1.0, None, "dynamic"),
                                                     (0.7, 4, "static"), (1.0, None, "adaptive")])
def test_sampling_follows_the_target_with_a_reduced_draft_vocabulary(temperature, top_k, shape, monkeypatch):
    """A draft vocabulary of 5 of the 8 tokens, blocks of 3 slots (2 drafts): the first 3
    tokens' joint law is the target's, by enumeration; also under Adaptive, whose sampled
    rounds are priced by a verification of 1 + 0.5 (w - 1) (the block cut to 1 or 2 slots by
    the pooled acceptance, and chains stopped by keep_drafting on the drafts before)."""
    from spec_ext.policies import Adaptive, Costs
    target = llama(VOCAB, 32, 4, seed=10, sharpen=3.0)
    draft = random_dflash(target, block=3, draft_vocab=5, seed=4, scale=0.5)
    costs = Costs()
    for w in range(1, 5):
        costs.record_verify(256, w, 1.0 + 0.5 * (w - 1))
    monkeypatch.setattr("spec_ext.policies.estimates.round_costs", lambda call, schedule, sequential: costs)
    policy = {"chain": Fixed(2), "dynamic": DynamicTree(depth=2, top_k=3, nodes=6), "static": Tree((2, 1)),
              "adaptive": Adaptive(max_draft=2)}[shape]
    n = 12_000
    out = spec_ext.generate(target, draft, [PROMPT] * n, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            eos_token_id=[], policy=policy, seed=7)
    assert 0 < out.stats.accepted < out.stats.drafted, out.stats
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(temperature, top_k)))


def test_a_chain_carries_each_drafts_confidence(target, trained):
    """Proposal.confidence: q at each draft when sampling, the processed softmax when greedy."""
    seen = []

    class Recording(BlockDrafter):
        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            proposal = super().propose(seqs, roots, plan, forced, forced_rows)
            seen.append(proposal)
            return proposal

    for temperature in (0.0, 0.8):
        seen.clear()
        spec_ext.generate(target, Recording(trained), PROMPTS, max_new_tokens=6, eos_token_id=[],
                          temperature=temperature, seed=1, policy=Fixed(3))
        proposal = seen[0]
        assert proposal.confidence.shape == proposal.tokens.shape
        if temperature:
            expected = proposal.q.gather(2, proposal.tokens[..., None])[..., 0]
            torch.testing.assert_close(proposal.confidence, expected)
        assert bool(((proposal.confidence > 0) & (proposal.confidence <= 1)).all())


# ---------------------------------------------------------------------- formats
def state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_speculators_layout_round_trips_bit_equal(target, tmp_path):
    for name, vocab in (("full", None), ("reduced", 8)):
        draft = random_dflash(target, draft_vocab=vocab, layers=2, seed=2,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                              use_sliding_window=True)
        draft.save(tmp_path / name)
        assert is_dflash_directory(tmp_path / name)
        loaded = load_dflash(tmp_path / name)
        assert state_equal(loaded, draft) and loaded.config == draft.config
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 2, 4]
        assert config["block_size"] == 4 and config["mask_token_id"] == V - 1
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        loaded.save(tmp_path / (name + "-again"))
        assert (tmp_path / name / "model.safetensors").read_bytes() == \
            (tmp_path / (name + "-again") / "model.safetensors").read_bytes()
    # what the library's save_pretrained adds beside the fields (speculators 0.9.0 writes these)
    library = dict(config, architectures=["DFlashDraftModel"], auto_map={"": "config.DFlashSpeculatorConfig"},
                   dtype="float32", tie_word_embeddings=False, transformers_version="5.19.0")
    (tmp_path / "reduced" / "config.json").write_text(json.dumps(library))
    assert state_equal(load_dflash(tmp_path / "reduced"), draft)


def test_a_zlab_layout_loads_with_its_layer_ids_shifted(target, trained, tmp_path):
    """z-lab's config (Qwen3 fields, block_size, num_target_layers, dflash_config) names
    target layer i for HF's hidden_states[i + 1]."""
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = dict(trained.config.layer, architectures=["DFlashDraftModel"], block_size=4, num_target_layers=4,
                  dflash_config=dict(target_layer_ids=[k - 1 for k in trained.config.layer_ids],
                                     mask_token_id=V - 1))
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_dflash(tmp_path)
    assert loaded.config.layer_ids == trained.config.layer_ids and state_equal(loaded, trained)
    a = spec_ext.generate(target, str(tmp_path), PROMPTS, max_new_tokens=12, eos_token_id=[], policy=Fixed(3))
    b = spec_ext.generate(target, trained, PROMPTS, max_new_tokens=12, eos_token_id=[], policy=Fixed(3))
    assert a.sequences.tolist() == b.sequences.tolist() and a.stats.accepted == b.stats.accepted > 0


def test_a_dflash_directory_is_a_draft_path_for_generate_and_accelerate(target, trained, tmp_path):
    trained.save(tmp_path)
    ids = torch.tensor([PROMPTS[0]])
    fast = spec_ext.accelerate(target, str(tmp_path), policy=Fixed(3))
    got = fast.generate(ids, max_new_tokens=16, eos_token_id=[])
    assert got.tolist() == target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                           pad_token_id=0).tolist()
    assert fast.last_stats.accepted > 0


def test_the_command_line_takes_a_dflash_directory_as_its_draft(tmp_path):
    from spec_ext.__main__ import load_pair
    from spec_ext.bundled import bundled_path
    target_dir = bundled_path("stdlib-target")
    _, target, _ = load_pair(target_dir, None)
    random_dflash(target, block=4, layer_ids=(1, 2)).save(tmp_path)
    _, target, draft = load_pair(target_dir, tmp_path)
    assert isinstance(draft, DFlashDraft)
    ids = [[5, 17, 33, 8]]
    out = spec_ext.generate(target, draft, ids, max_new_tokens=8, eos_token_id=[], policy="fixed")
    expected = target.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.sequences.tolist() == expected.tolist()


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change,field", [
    (dict(layer_ids=(1, 2, 9)), "aux_hidden_state_layer_ids"),
    (dict(target_hidden_size=48), "target_hidden_size"),
    (dict(vocab=V + 4), "transformer_layer_config.vocab_size"),
    (dict(num_target_layers=6), "num_target_layers"),
    (dict(policy=Tree((2, 2, 1, 1))), "policy: .* grows trees 4 deep; a block drafter drafts at most 3 in a line"),
    (dict(policy=spec_ext.policies.PEARL()), "policy: PEARL drafts while the target verifies"),
    (dict(policy=spec_ext.policies.SpecBranch()), "policy: SpecBranch drafts while the target verifies"),
])
def test_a_drafter_for_another_target_or_policy_is_refused_by_name(target, change, field):
    text = target.config
    layer = layer_config(32, change.get("vocab", V))
    config = DFlashConfig(layer, 4, change.get("layer_ids", (1, 2, 4)), V - 1,
                          target_hidden_size=change.get("target_hidden_size"),
                          num_target_layers=change.get("num_target_layers"))
    assert text.num_hidden_layers == 4
    with pytest.raises(ValueError, match=field):
        spec_ext.generate(target, DFlashDraft(config), PROMPTS, max_new_tokens=4,
                          policy=change.get("policy", Fixed(3)))


def test_bad_configs_are_refused_by_field(tmp_path):
    with pytest.raises(ValueError, match="mask_token_id: 12 is not a token"):
        DFlashConfig(layer_config(32, V), 4, (1,), V)
    with pytest.raises(ValueError, match="mask_token_id: None"):
        DFlashConfig(layer_config(32, V), 4, (1,), None)
    with pytest.raises(ValueError, match="block_size: 1 proposes no draft"):
        DFlashConfig(layer_config(32, V), 1, (1,), 3)
    with pytest.raises(ValueError, match="draft_vocab_size: 20"):
        DFlashConfig(layer_config(32, V), 4, (1,), 3, draft_vocab_size=20)
    target = llama(V, 32, 4, seed=3)
    base = random_dflash(target)
    base.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for change, field in ((dict(projector_type="domino"), "projector_type: 'domino'"),
                          (dict(shift_label=True), "shift_label"),
                          (dict(speculators_model_type="dspark"), "speculators_model_type: 'dspark'"),
                          (dict(speculators_model_type="dflash2"), "speculators_model_type: 'dflash2'"),
                          (dict(markov_head_rank=8), "markov_head_rank: a speculators dflash field"),
                          (dict(aux_hidden_state_layer_ids=None), "aux_hidden_state_layer_ids: missing")):
        (tmp_path / "config.json").write_text(json.dumps({**saved, **change}))
        with pytest.raises(ValueError, match=field):
            load_dflash(tmp_path)
    zlab = dict(base.config.layer, block_size=4, num_target_layers=4,
                dflash_config=dict(target_layer_ids=[0, 1, 3], mask_token_id=V - 1))
    for change, field in ((dict(conv_kernel_size=4), "dflash_config.conv_kernel_size: a DFlash2 checkpoint"),
                          (dict(output_multiplier=2.0), "dflash_config.output_multiplier"),
                          (dict(mask_token_id=V + 3), "mask_token_id")):
        config = dict(zlab, dflash_config={**zlab["dflash_config"], **change})
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=field):
            load_dflash(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(zlab, layer_types=["sliding_attention"],
                                                          sliding_window=4, use_sliding_window=True)))
    with pytest.raises(ValueError, match="layer_types: sliding layers of a z-lab checkpoint"):
        load_dflash(tmp_path)


def test_a_policy_reading_the_bonus_agreement_is_refused(target, trained):
    with pytest.raises(ValueError, match="policy: AdaLength reads the drafter's agreement .* a block drafter has no "
                                         "slot past its drafts"):
        spec_ext.generate(target, trained, PROMPTS, max_new_tokens=4, policy=spec_ext.policies.AdaLength())


@pytest.mark.parametrize("tree", [False, True])
def test_text_drafts_run_beside_a_block_drafter(target, trained, tree):
    """NGram beside a block drafter: rows whose text matches draft it, the others a block, in
    the same round; greedy output equals the target's and both kinds of drafts are accepted."""
    out = ragged_greedy_equals_target(target, trained, PROMPTS + [[6]], spec_ext.policies.NGram(tree=tree, draft_k=3),
                                      max_new=24)
    by_source = out.stats.by_source
    assert by_source["model"].accepted > 0 and by_source["text"].accepted > 0, out.stats.as_dict()
    assert out.stats.matched > 0 and out.stats.draft_calls > 0
