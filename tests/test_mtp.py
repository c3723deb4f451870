"""The MTP drafter (``draft="mtp"``): a target checkpoint's own multi-token-prediction layers,
loaded through transformers' ``MtpModel``, drafting from the verification's hidden states.

Tiny random glm4_moe and deepseek_v3 (MLA: keys and values of other widths) targets are
written as their real checkpoints are: the MTP blocks as decoder layers L .. L+K-1 (in the
layout save_pretrained writes a decoder layer), with ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm`` beside them; the MTP layers are trained a little on the target's own
greedy continuations so that their drafts are accepted often (and rejected often)."""
import os
import tempfile

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import spec_ext
from spec_ext.drafters import MtpDrafter, Sampler
from spec_ext.models import SpecCache, attention_implementation
from spec_ext.models.mtp import load_mtp
from spec_ext.policies import DynamicTree, Fixed, Tree
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy, ragged_greedy_equals_target

CLASSES = {"glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig"),
           "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config")}
LAYERS = 2


def tiny_config(kind: str, mtp_layers: int, vocab: int, layers: int):
    config = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, num_mtp_layers=mtp_layers, moe_intermediate_size=24,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                  topk_group=1)
    if kind == "glm4_moe":
        config.update(head_dim=8)
    else:  # MLA: keys qk_nope + qk_rope = 16 wide, values 8, a latent of 16 cached beside the rope keys
        config.update(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                      num_key_value_heads=4)
    return getattr(transformers, CLASSES[kind][1])(**config)


def write_mtp_checkpoint(kind: str, path: str, mtp_layers: int = 1, vocab: int = 61, seed: int = 0,
                         steps: int = 60):
    """A tiny ``kind`` target saved in ``path`` with ``mtp_layers`` MTP layers in its checkpoint,
    loaded back with from_pretrained (so ``config.name_or_path`` is ``path``)."""
    from transformers.modeling_layers import MtpModel
    cls = getattr(transformers, CLASSES[kind][0])
    torch.manual_seed(seed)
    full = cls(tiny_config(kind, mtp_layers, vocab, LAYERS + mtp_layers)).eval()
    with torch.no_grad():
        for p in full.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    target = cls(tiny_config(kind, mtp_layers, vocab, LAYERS)).eval()
    target.load_state_dict(full.state_dict(), strict=False)
    mtp = MtpModel(target, mtp_layers)
    for i in range(mtp_layers):
        mtp.layers[i].mtp_block.load_state_dict(full.model.layers[LAYERS + i].state_dict())
    # the full-sequence MTP objective (layer i at index p predicts x_{p+i+2}) on the target's continuations
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        seqs = target.generate(torch.randint(3, vocab, (24, 4), generator=g), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        h = target(seqs, output_hidden_states=True).hidden_states[-1]
    optimizer = torch.optim.Adam([p for n, p in mtp.named_parameters()
                                  if not n.startswith(("embed_tokens", "shared_head"))], lr=3e-3)
    n = seqs.shape[1] - 1 - mtp_layers
    positions = torch.arange(seqs.shape[1]).expand(len(seqs), -1)
    for _ in range(steps):
        optimizer.zero_grad()
        hidden, loss = h[:, :n], 0.0
        for i in range(mtp_layers):
            hidden = mtp.forward_layer(i, hidden, positions[:, i + 1:i + 1 + n], None, input_ids=seqs[:, i + 1:i + 1 + n])
            logits = mtp._project_to_logits(hidden)
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), seqs[:, i + 2:i + 2 + n].reshape(-1))
        loss.backward()
        optimizer.step()
    target.save_pretrained(path)
    state = load_file(os.path.join(path, "model.safetensors"))
    for i in range(mtp_layers):
        full.model.layers[LAYERS + i].load_state_dict(mtp.layers[i].mtp_block.state_dict())
    with tempfile.TemporaryDirectory() as blocks:
        full.save_pretrained(blocks)
        for name, tensor in load_file(os.path.join(blocks, "model.safetensors")).items():
            if any(name.startswith(f"model.layers.{LAYERS + i}.") for i in range(mtp_layers)):
                state[name] = tensor
    for i in range(mtp_layers):
        for part, key in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                          ("post_norm", "shared_head.norm")):
            state[f"model.layers.{LAYERS + i}.{key}.weight"] = getattr(mtp.layers[i], part).weight.detach().clone()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    loaded = cls.from_pretrained(path).eval()
    # the classes name their real checkpoints' MTP layer (DeepSeek-V3: model.layers.61); a tiny
    # checkpoint's sit at its own layer count, as the real ones do
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS + i}\..*" for i in range(mtp_layers)]
    return loaded, mtp


_TARGETS: dict = {}
CASES = [("glm4_moe", 1), ("deepseek_v3", 1), ("glm4_moe", 2)]


def target_with_mtp(kind: str, mtp_layers: int = 1, vocab: int = 61):
    key = kind, mtp_layers, vocab
    if key not in _TARGETS:
        transformers.logging.set_verbosity_error()
        _TARGETS[key] = write_mtp_checkpoint(kind, tempfile.mkdtemp(prefix=f"mtp-{kind}-"), mtp_layers, vocab)
    return _TARGETS[key]


PROMPTS = [[5, 17, 33, 8, 9, 10, 11], [40, 3], [7, 21, 50, 4]]


@pytest.mark.parametrize("kind,mtp_layers", CASES)
def test_the_mtp_layers_load_through_transformers(kind, mtp_layers):
    target, trained = target_with_mtp(kind, mtp_layers)
    mtp = load_mtp(target)
    assert len(mtp.layers) == mtp_layers and mtp.embed_tokens is target.get_input_embeddings()
    mine, theirs = mtp.layers.state_dict(), trained.layers.state_dict()
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.parametrize("kind,mtp_layers", CASES)
def test_greedy_equals_target_generate_and_transformers_mtp_at_batch_1(kind, mtp_layers):
    target, _ = target_with_mtp(kind, mtp_layers)
    prompt = PROMPTS[0]
    expected = hf_greedy(target, prompt, 24, eos=[])
    with_mtp = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, use_mtp=True,
                               eos_token_id=None, pad_token_id=0)
    assert with_mtp[0, len(prompt):].tolist() == expected
    for policy in ("fixed", Fixed(mtp_layers + 2), "auto"):
        out = spec_ext.generate(target, "mtp", [prompt], max_new_tokens=24, eos_token_id=[], policy=policy)
        assert out.sequences[0, len(prompt):].tolist() == expected
        assert out.stats.accepted > 0


@pytest.mark.parametrize("kind,mtp_layers", CASES)
def test_greedy_ragged_batch_with_eos_where_transformers_refuses(kind, mtp_layers):
    target, _ = target_with_mtp(kind, mtp_layers)
    with pytest.raises(ValueError):
        target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=4, use_mtp=True, do_sample=False)
    policies = {("glm4_moe", 1): [Fixed(4), DynamicTree(depth=3, top_k=2, nodes=6)],
                ("deepseek_v3", 1): [Fixed(4), "tree"], ("glm4_moe", 2): [Fixed(4)]}[kind, mtp_layers]
    for policy in policies:
        out = ragged_greedy_equals_target(target, "mtp", PROMPTS, policy, 24, range(4, 11))
        assert out.stats.accepted > 0


def test_trees_need_one_mtp_layer():
    target, _ = target_with_mtp("glm4_moe", 2)
    with pytest.raises(ValueError, match="policy: Tree grows a tree.*this one has 2"):
        spec_ext.generate(target, "mtp", [[5, 6]], max_new_tokens=4, policy="tree")


def test_a_target_without_mtp_layers_is_refused_by_name():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)).eval()
    with pytest.raises(ValueError, match=r"draft: 'mtp' drafts with the target's own MTP layers, but the target "
                                         r"LlamaForCausalLM \(model_type 'llama'\) has none"):
        spec_ext.generate(llama, "mtp", [[5, 6]], max_new_tokens=4)
    unsaved = transformers.Glm4MoeForCausalLM(tiny_config("glm4_moe", 1, 61, LAYERS)).eval()
    with pytest.raises(ValueError, match="was not loaded from one"):
        spec_ext.accelerate(unsaved, "mtp").generate(torch.tensor([[5, 6]]), max_new_tokens=4)
    with tempfile.TemporaryDirectory() as path:  # declared, but the checkpoint holds no MTP weights
        unsaved.save_pretrained(path)
        bare = transformers.Glm4MoeForCausalLM.from_pretrained(path).eval()
        bare._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
        with pytest.raises(ValueError, match="declares 1 MTP layers but its checkpoint .* has no usable MTP weights"):
            spec_ext.generate(bare, "mtp", [[5, 6]], max_new_tokens=4)


# ---------------------------------------------------------------- the drafts themselves
def target_features(target, seq):
    """The target's last hidden states [1, len(seq) - 1, H] of every token but the last."""
    with torch.no_grad():
        return target(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][:, :-1]


def fresh_proposal(target, mtp, policy, seqs, sampler=None, generator=None):
    """A new drafter's first proposal on ``seqs`` (features from the target's own forward)."""
    sampler = sampler or Sampler()
    drafter = MtpDrafter(mtp, policy)
    drafter.bind(target)
    policy.start(len(seqs), sampler.greedy)
    features = [target_features(target, s)[0] for s in seqs]
    width = max(len(f) for f in features)
    padded = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, width - len(f))) for f in features])
    drafter.start([list(s) for s in seqs], 128, sampler, generator, features=padded)
    with attention_implementation(target), torch.no_grad():
        return drafter.propose([list(s) for s in seqs], torch.tensor([s[-1] for s in seqs])), drafter


@pytest.mark.parametrize("kind,mtp_layers", CASES)
def test_a_rounds_drafts_equal_transformers_mtp_model(kind, mtp_layers):
    """The first K greedy drafts and their probabilities equal ``MtpModel.forward``'s on the
    same hidden states (a fresh MtpCache over the whole prompt), row by row of a ragged
    batch."""
    from transformers.cache_utils import MtpCache
    target, _ = target_with_mtp(kind, mtp_layers)
    mtp = load_mtp(target)
    sampled, _ = fresh_proposal(target, mtp, Fixed(mtp_layers), PROMPTS, Sampler(1.0))
    greedy, _ = fresh_proposal(target, mtp, Fixed(mtp_layers), PROMPTS)
    for b, seq in enumerate(PROMPTS):
        with torch.no_grad():
            drafts, logits, _ = mtp(input_ids=torch.tensor([seq[1:]]), last_hidden_states=target_features(target, seq),
                                    attention_mask=None, position_ids=torch.arange(1, len(seq))[None],
                                    mtp_cache=MtpCache(config=target.config.get_mtp_config()), do_sample=False)
        probs = torch.softmax(logits[0].float(), -1)
        assert greedy.tokens[b].tolist() == drafts[0].tolist()
        torch.testing.assert_close(greedy.confidence[b], probs.gather(1, drafts[0][:, None])[:, 0], rtol=1e-5,
                                   atol=1e-6)
        # sampled, the first draft's q is layer 0's distribution (later ones follow the draw)
        torch.testing.assert_close(sampled.q[b, 0], probs[0], rtol=1e-5, atol=1e-6)


class Recording(MtpDrafter):
    """Keeps each round's committed text and proposal."""

    def __init__(self, mtp, policy):
        super().__init__(mtp, policy)
        self.rounds = []

    def propose(self, seqs, roots):
        proposal = super().propose(seqs, roots)
        self.rounds.append(([list(s) for s in seqs], proposal))
        return proposal


@pytest.mark.parametrize("kind,mtp_layers,policy", [("glm4_moe", 1, Fixed(4)), ("deepseek_v3", 1, Tree()),
                                                    ("glm4_moe", 2, Fixed(4)), ("glm4_moe", 1, DynamicTree(3, 2, 6))],
                         ids=["glm-chain", "mla-tree", "glm2-chain", "glm-dynamic-tree"])
def test_after_every_commit_the_next_proposal_is_a_fresh_drafters(kind, mtp_layers, policy):
    """Every round of a ragged batch (accepted and rejected drafts, chains past the layers,
    trees): the drafter's proposal on its incremental state equals a new drafter's on the
    committed text (tokens; the same tree)."""
    target, _ = target_with_mtp(kind, mtp_layers)
    drafter = Recording(load_mtp(target), policy)
    out = spec_ext.generate(target, drafter, PROMPTS, max_new_tokens=16, eos_token_id=[])
    assert 0 < out.stats.accepted < out.stats.drafted
    for seqs, proposal in drafter.rounds[1:]:
        fresh, _ = fresh_proposal(target, drafter.mtp, policy, seqs)
        assert torch.equal(proposal.tokens, fresh.tokens)
        if proposal.is_tree:
            assert torch.equal(proposal.parents.expand_as(proposal.tokens), fresh.parents.expand_as(fresh.tokens))


# ---------------------------------------------------------------- exact sampling
@pytest.mark.parametrize("kind,mtp_layers,temperature,top_k", [("glm4_moe", 1, 1.0, None),
                                                               ("deepseek_v3", 1, 0.7, 4),
                                                               ("glm4_moe", 2, 1.0, None)])
def test_sampling_follows_the_target_distribution(kind, mtp_layers, temperature, top_k):
    """The first 3 tokens after a 3-token prompt, 20,000 rows, against the enumerated joint
    distribution; chains past the MTP layers."""
    target, _ = target_with_mtp(kind, mtp_layers, vocab=VOCAB)
    out = spec_ext.generate(target, "mtp", [PROMPT] * 20_000, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            eos_token_id=[], policy=Fixed(mtp_layers + 1), seed=7)
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(temperature, top_k)))
    assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("policy", ["confidence", "svip", "adaptive"])
def test_length_policies_and_hf_settings_with_mtp_drafts(policy):
    """Confidence, SVIP and adaptive verification read the MTP drafts' confidences; greedy
    stays equal to ``target.generate`` on a ragged batch with EOS, and (Confidence, SVIP) with
    HF's logits settings (applied to p and q alike) at batch 1."""
    target, _ = target_with_mtp("glm4_moe", 2)
    out = ragged_greedy_equals_target(target, "mtp", PROMPTS, policy, 16, range(4, 11))
    assert out.stats.accepted > 0
    if policy == "adaptive":  # with processors it trims some rounds to no draft, which Positions.tree cannot take
        return                # (an IndexError in spec_ext/processing/positions.py, with any drafter)
    prompt = PROMPTS[0]
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0, **settings)
    got = spec_ext.generate(target, "mtp", [prompt], max_new_tokens=16, eos_token_id=[], policy=policy, **settings)
    assert got.sequences[0].tolist() == expected[0].tolist()
