"""The MTP drafter (``draft="mtp"``): a target checkpoint's own multi-token-prediction layers,
loaded through transformers' ``MtpModel``, drafting from the verification's hidden states.

Tiny random targets of every architecture transformers loads MTP layers for and spec_ext can
decode are written as their real checkpoints are laid out: glm4_moe, deepseek_v3 (MLA: keys
and values of other widths) and step3p7 (a multimodal model; per-layer query head counts and
RoPE, sliding-window layers) keep the MTP blocks as decoder layers L .. L+K-1 with ``enorm``,
``hnorm``, ``eh_proj`` and ``shared_head.norm`` beside them; ernie4_5_moe as ``mtp_block.{k}``,
``mtp_emb_norm.{k}``, ``mtp_hidden_norm.{k}``, ``mtp_linear_proj.{k}`` with the main model's
final norm as the MTP post-norm; mellum (a sliding-window MTP layer with its own RoPE) as
``mtp.layers.0``, ``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm``. Each block is written in the
layout the architecture's ``save_pretrained`` writes a decoder layer (its weight conversions
reverted). The MTP layers are trained a little on the target's own greedy continuations so
that their drafts are accepted often (and rejected often). bailing_hybrid and inkling are
refused by name (recurrent layers)."""
import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import spec_ext
from spec_ext.drafters import MtpDrafter, Sampler
from spec_ext.models import attention_implementation
from spec_ext.models.mtp import load_mtp
from spec_ext.policies import DynamicTree, Fixed, Tree
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy, plan_of, ragged_greedy_equals_target

CLASSES = {"glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig"),
           "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config"),
           "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig"),
           "mellum": ("MellumForCausalLM", "MellumConfig"),
           "step3p7": ("Step3p7ForConditionalGeneration", "Step3p7Config")}
LAYERS = 2


def tiny_config(kind: str, mtp_layers: int, vocab: int, layers: int):
    config = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, num_mtp_layers=mtp_layers)
    deepseek_moe = dict(moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1)
    if kind == "glm4_moe":
        config.update(head_dim=8, **deepseek_moe)
    elif kind == "deepseek_v3":  # MLA: keys qk_nope + qk_rope = 16 wide, values 8, a latent of 16 cached, rope keys
        config.update(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                      num_key_value_heads=4, **deepseek_moe)
    elif kind == "ernie4_5_moe":  # layer 1 MoE; the MTP block (index 0 of the MTP config) dense, as transformers has it
        # untied: a random target with its head tied to the embedding repeats its last token, which a layer trained
        # on 24 sequences learns for the tokens it saw only
        config.update(head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=24, moe_layer_start_index=1,
                      tie_word_embeddings=False)
    elif kind == "mellum":  # the MTP layer is a sliding-window one (window 4), with that layer type's own RoPE
        config.update(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, sliding_window=4,
                      layer_types=["sliding_attention", "full_attention"][:layers])
    elif kind == "step3p7":  # the legacy layout: per-layer lists padded with the MTP layers' entries
        del config["num_mtp_layers"]
        types = (["sliding_attention", "full_attention"] * layers)[:layers]
        types += ["full_attention", "sliding_attention"][:mtp_layers]
        text = dict(config, head_dim=8, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                    share_expert_dim=24, num_nextn_predict_layers=mtp_layers, sliding_window=4,
                    num_sliding_attention_heads=2, layer_types=types,
                    rope_theta=[10_000.0 if t == "sliding_attention" else 500_000.0 for t in types],
                    mlp_layer_types=(["dense"] + ["sparse"] * (len(types) - 1)))
        return transformers.Step3p7Config(text_config=text, vision_config=dict(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14))
    return getattr(transformers, CLASSES[kind][1])(**config)


def checkpoint_names(kind: str, layer: int) -> dict:
    """Where the real checkpoints of ``kind`` keep MTP layer ``layer``'s parts (the block's
    weights under ``block``; None: the part is a main-model weight, ``SHARED``)."""
    if kind == "ernie4_5_moe":
        return dict(block=f"model.mtp_block.{layer}.", enorm=f"model.mtp_emb_norm.{layer}.",
                    hnorm=f"model.mtp_hidden_norm.{layer}.", eh_proj=f"model.mtp_linear_proj.{layer}.", post_norm=None)
    if kind == "mellum":
        return dict(block=f"mtp.layers.{layer}.", enorm="mtp.pre_fc_norm_embedding.", hnorm="mtp.pre_fc_norm_hidden.",
                    eh_proj="mtp.fc.", post_norm="mtp.norm.")
    at = f"model.layers.{LAYERS + layer}."
    return dict(block=at, enorm=at + "enorm.", hnorm=at + "hnorm.", eh_proj=at + "eh_proj.",
                post_norm=at + "shared_head.norm.")


# MTP-layer parts that are the main model's weights in the checkpoint (ERNIE: the final norm)
SHARED = {"ernie4_5_moe": {"post_norm": "model.norm"}}


def block_carrier(cls, target):
    """A ``cls`` model whose decoder layers are built from the MTP config (what ``MtpModel``
    builds its blocks from): the blocks initialised as the architecture initialises its
    layers, and ``save_pretrained`` writes them in the checkpoint's layout."""
    mtp_config = target.config.get_mtp_config()
    if target.config.get_text_config() is target.config:
        return cls(mtp_config).eval()
    text = mtp_config.to_dict()  # a multimodal config: the MTP config as its text config, per-layer overrides kept
    text["per_layer_config"] = text.get("per_layer_config") or {}
    return cls(type(target.config)(**{**target.config.to_dict(), "text_config": text})).eval()


def write_mtp_checkpoint(kind: str, path: str, mtp_layers: int = 1, vocab: int = 61, seed: int = 0,
                         steps: int = 60):
    """A tiny ``kind`` target saved in ``path`` with ``mtp_layers`` MTP layers in its checkpoint,
    loaded back with from_pretrained (so ``config.name_or_path`` is ``path``), and the trained
    ``MtpModel`` the checkpoint holds."""
    from transformers.modeling_layers import MtpModel
    cls = getattr(transformers, CLASSES[kind][0])
    torch.manual_seed(seed)
    target = cls(tiny_config(kind, mtp_layers, vocab, LAYERS)).eval()
    carrier = block_carrier(cls, target)
    with torch.no_grad():
        for p in [*target.parameters(), *carrier.parameters()]:
            if p.dim() >= 2:
                p.mul_(3.0)
    mtp = MtpModel(target, mtp_layers)
    shared = SHARED.get(kind, {})
    main = dict(target.named_parameters())
    with torch.no_grad():
        for i in range(mtp_layers):
            mtp.layers[i].mtp_block.load_state_dict(carrier.get_decoder().layers[i].state_dict())
            for part, name in shared.items():
                getattr(mtp.layers[i], part).weight.copy_(main[f"{name}.weight"])
    frozen = {f"layers.{i}.{part}.weight" for i in range(mtp_layers) for part in shared}
    # the full-sequence MTP objective (layer i at index p predicts x_{p+i+2}) on the target's continuations
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        seqs = target.generate(torch.randint(3, vocab, (24, 4), generator=g), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        h = target(seqs, output_hidden_states=True).hidden_states[-1]
    optimizer = torch.optim.Adam([p for n, p in mtp.named_parameters()
                                  if not n.startswith(("embed_tokens", "shared_head")) and n not in frozen], lr=3e-3)
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
    blocks = os.path.join(path, "blocks")  # removed below: from_pretrained reads path's own files only
    for i in range(mtp_layers):
        carrier.get_decoder().layers[i].load_state_dict(mtp.layers[i].mtp_block.state_dict())
    carrier.save_pretrained(blocks)
    written = load_file(os.path.join(blocks, "model.safetensors"))
    shutil.rmtree(blocks)
    for i in range(mtp_layers):
        names, layer = checkpoint_names(kind, i), re.compile(rf"(^|\.)layers\.{i}\.")
        for name, tensor in written.items():  # the carrier's decoder layer i, in the checkpoint's layout
            found = layer.search(name)
            if found and "vision" not in name:
                state[names["block"] + name[found.end():]] = tensor
        for part in ("enorm", "hnorm", "eh_proj", "post_norm"):
            if names[part] is not None:
                state[names[part] + "weight"] = getattr(mtp.layers[i], part).weight.detach().clone()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    loaded = cls.from_pretrained(path).eval()
    if kind in ("glm4_moe", "deepseek_v3"):
        # the classes name their real checkpoints' MTP layer (DeepSeek-V3: model.layers.61); a tiny
        # checkpoint's sit at its own layer count, as the real ones do
        loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS + i}\..*" for i in range(mtp_layers)]
    return loaded, mtp


_TARGETS: dict = {}
CASES = [("glm4_moe", 1), ("deepseek_v3", 1), ("glm4_moe", 2), ("ernie4_5_moe", 1), ("mellum", 1), ("step3p7", 2)]
_TMP: list = []  # pytest's tmp_path_factory: the checkpoints the module shares live under its base temp


@pytest.fixture(autouse=True, scope="module")
def _checkpoints_under_pytest_tmp(tmp_path_factory):
    _TMP[:] = [tmp_path_factory]
    yield
    _TARGETS.clear()
    _LIBRARY.clear()


def scratch(name: str) -> str:
    """A new directory for ``name`` under pytest's base temp (never /tmp itself)."""
    return str(_TMP[0].mktemp(name))


def target_with_mtp(kind: str, mtp_layers: int = 1, vocab: int = 61):
    key = kind, mtp_layers, vocab
    if key not in _TARGETS:
        transformers.logging.set_verbosity_error()
        _TARGETS[key] = write_mtp_checkpoint(kind, scratch(f"mtp-{kind}-"), mtp_layers, vocab)
    return _TARGETS[key]


PROMPTS = [[5, 17, 33, 8, 9, 10, 11], [40, 3], [7, 21, 50, 4]]


@pytest.mark.parametrize("kind,mtp_layers", CASES)
def test_the_mtp_layers_load_through_transformers(kind, mtp_layers):
    """``MtpModel.from_pretrained`` reads back every weight written in the architecture's layout
    (its regex and renamings), bit-equal to the trained model's (the embedding and head: the
    target's; ERNIE's post-norm: the target's final norm)."""
    target, trained = target_with_mtp(kind, mtp_layers)
    mtp = load_mtp(target)
    assert len(mtp.layers) == mtp_layers and mtp.embed_tokens is target.get_input_embeddings()
    mine, theirs = mtp.state_dict(), trained.state_dict()
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
                ("deepseek_v3", 1): [Fixed(4), "tree"],
                ("glm4_moe", 2): [Fixed(4), Tree(), DynamicTree(depth=4, top_k=2, nodes=8)],
                ("ernie4_5_moe", 1): [Fixed(4), DynamicTree(depth=3, top_k=2, nodes=6)],
                ("mellum", 1): [Fixed(4), "tree"],
                ("step3p7", 2): [Fixed(4), DynamicTree(depth=4, top_k=2, nodes=8)]}[kind, mtp_layers]
    for policy in policies:
        out = ragged_greedy_equals_target(target, "mtp", PROMPTS, policy, 24, range(4, 11))
        assert out.stats.accepted > 0


def test_a_trees_first_children_are_the_greedy_chain():
    """Trees of a checkpoint of two MTP layers draft each depth with the layer a chain uses
    there (layer min(d, K) - 1 for depth d, the last one again past K): the path of first
    children of a static tree is the greedy chain, row by row of a ragged batch (a two-token
    prompt among them, whose first round has no committed index for layer 1's root)."""
    target, _ = target_with_mtp("glm4_moe", 2)
    mtp = load_mtp(target)
    policy = Tree((2, 2, 2, 1))
    tree, _ = fresh_proposal(target, mtp, policy, PROMPTS)
    chain, _ = fresh_proposal(target, mtp, Fixed(4), PROMPTS)
    first = [level[0] for level in policy.tree_shape().levels]
    assert torch.equal(tree.tokens[:, first], chain.tokens)
    assert len({tuple(row) for row in chain.tokens.tolist()}) == len(PROMPTS)


def test_a_target_without_mtp_layers_is_refused_by_name(tmp_path):
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)).eval()
    with pytest.raises(ValueError, match=r"draft: 'mtp' drafts with the target's own MTP layers, but the target "
                                         r"LlamaForCausalLM \(model_type 'llama'\) has none"):
        spec_ext.generate(llama, "mtp", [[5, 6]], max_new_tokens=4)
    unsaved = transformers.Glm4MoeForCausalLM(tiny_config("glm4_moe", 1, 61, LAYERS)).eval()
    with pytest.raises(ValueError, match="was not loaded from one"):
        spec_ext.accelerate(unsaved, "mtp").generate(torch.tensor([[5, 6]]), max_new_tokens=4)
    unsaved.save_pretrained(tmp_path)  # declared, but the checkpoint holds no MTP weights
    bare = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path).eval()
    bare._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    with pytest.raises(ValueError, match="declares 1 MTP layers but its checkpoint .* has no usable MTP weights"):
        spec_ext.generate(bare, "mtp", [[5, 6]], max_new_tokens=4)


def refused_target(kind: str):
    """A tiny random ``kind`` target with one MTP layer (in memory: the refusal comes before
    anything is read)."""
    config = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, num_mtp_layers=1)
    if kind == "bailing_hybrid":  # layer 0 linear attention (KDA), layer 1 full (MLA)
        return transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(
            **config, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, layer_group_size=2))
    if kind == "inkling":  # short convolutions beside every attention, a relative position bias
        return transformers.InklingForCausalLM(transformers.InklingTextConfig(**config))
    # a mellum whose MTP layer would be a linear-attention one (no released architecture: the guard itself)
    return transformers.MellumForCausalLM(transformers.MellumConfig(
        **config, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mtp_layer_types=["linear_attention"]))


@pytest.mark.parametrize("kind,message", [
    ("bailing_hybrid", r"target: BailingHybridForCausalLM \(model_type 'bailing_hybrid'\) is not supported: recurrent "
                       r"or state-space layers \('linear_attention' layers\): their state cannot be rolled back"),
    ("inkling", r"target: InklingForCausalLM \(model_type 'inkling_text'\) is not supported: recurrent or "
                r"state-space layers \('hybrid.*' layers\): their state cannot be rolled back"),
    ("linear-mtp-layer", r"draft: 'mtp' cannot draft with the MTP layers of the target MellumForCausalLM \(model_type "
                         r"'mellum'\): its MTP layer 0 is a 'linear_attention' layer")])
def test_architectures_spec_ext_cannot_decode_are_refused_by_name(kind, message):
    """bailing_hybrid (Ring-2.5: linear attention, recurrent) and Inkling (short convolutions,
    whose state is recurrent; its attention adds a position bias outside the attention
    interface) are refused by name with the reason before anything is loaded, through ``"mtp"``
    and through an ``MtpModel`` passed as the draft; MTP layers that are not attention layers
    are refused by the MTP guard (an ``MtpModel`` passed as the draft too)."""
    from transformers.modeling_layers import MtpModel
    target = refused_target(kind).eval()
    with pytest.raises(ValueError, match=message):
        spec_ext.generate(target, "mtp", [[5, 6]], max_new_tokens=4)
    if kind == "bailing_hybrid":  # transformers 5.25 cannot build its MTP layers (no mtp_layer_types)
        return
    drafter = MtpDrafter(MtpModel(target, 1))
    refusal = message if kind == "inkling" else r"draft: these MTP layers cannot draft: its MTP layer 0 is a 'linear"
    with pytest.raises(ValueError, match=refusal):
        spec_ext.generate(target, drafter, [[5, 6]], max_new_tokens=4, policy=Fixed(1))


# ---------------------------------------------------------------- the drafts themselves
def target_features(target, seq):
    """The target's last hidden states [1, len(seq) - 1, H] of every token but the last."""
    with torch.no_grad():
        return target(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][:, :-1]


def fresh_proposal(target, mtp, policy, seqs, sampler=None, generator=None):
    """A new drafter's first proposal on ``seqs`` (features from the target's own forward)."""
    sampler = sampler or Sampler()
    drafter = MtpDrafter(mtp)
    drafter.bind(target)
    plan = plan_of(policy, len(seqs), sampler.greedy, target, mtp)
    features = [target_features(target, s)[0] for s in seqs]
    width = max(len(f) for f in features)
    padded = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, width - len(f))) for f in features])
    drafter.start([list(s) for s in seqs], 128, sampler, generator, features=padded)
    with attention_implementation(target), torch.no_grad():
        return drafter.propose([list(s) for s in seqs], torch.tensor([s[-1] for s in seqs]), plan), drafter


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

    def __init__(self, mtp):
        super().__init__(mtp)
        self.rounds = []

    def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
        proposal = super().propose(seqs, roots, plan, forced, forced_rows)
        self.rounds.append(([list(s) for s in seqs], proposal))
        return proposal


@pytest.mark.parametrize("kind,mtp_layers,policy", [("glm4_moe", 1, Fixed(4)), ("deepseek_v3", 1, Tree()),
                                                    ("glm4_moe", 2, Fixed(4)), ("glm4_moe", 1, DynamicTree(3, 2, 6)),
                                                    ("glm4_moe", 2, Tree()), ("glm4_moe", 2, DynamicTree(4, 2, 8)),
                                                    ("glm4_moe", 2, Fixed(1)), ("mellum", 1, Tree()),
                                                    ("step3p7", 2, Fixed(4))],
                         ids=["glm-chain", "mla-tree", "glm2-chain", "glm-dynamic-tree", "glm2-tree",
                              "glm2-dynamic-tree", "glm2-chain-shorter-than-the-layers", "mellum-window-tree",
                              "step3p7-2-layers-chain"])
def test_after_every_commit_the_next_proposal_is_a_fresh_drafters(kind, mtp_layers, policy):
    """Every round of a ragged batch (accepted and rejected drafts, chains past the layers,
    trees): the drafter's proposal on its incremental state equals a new drafter's on the
    committed text (tokens; the same tree)."""
    target, _ = target_with_mtp(kind, mtp_layers)
    drafter = Recording(load_mtp(target))
    out = spec_ext.generate(target, drafter, PROMPTS, max_new_tokens=16, eos_token_id=[], policy=policy)
    assert 0 < out.stats.accepted < out.stats.drafted
    for seqs, proposal in drafter.rounds[1:]:
        fresh, _ = fresh_proposal(target, drafter.mtp, policy, seqs)
        assert torch.equal(proposal.tokens, fresh.tokens)
        if proposal.is_tree:
            assert torch.equal(proposal.parents.expand_as(proposal.tokens), fresh.parents.expand_as(fresh.tokens))


# ---------------------------------------------------------------- exact sampling
@pytest.mark.parametrize("kind,mtp_layers,temperature,top_k,policy", [
    ("glm4_moe", 1, 1.0, None, None), ("deepseek_v3", 1, 0.7, 4, None), ("glm4_moe", 2, 1.0, None, None),
    ("glm4_moe", 2, 1.0, None, Tree((2, 1, 1))), ("ernie4_5_moe", 1, 1.0, None, None),
    ("mellum", 1, 0.7, 4, None), ("step3p7", 2, 1.0, None, None)],
    ids=["glm", "mla-top-k", "glm2", "glm2-tree", "ernie", "mellum-sliding-top-k", "step3p7"])
def test_sampling_follows_the_target_distribution(kind, mtp_layers, temperature, top_k, policy):
    """The first 3 tokens after a 3-token prompt, 20,000 rows, against the enumerated joint
    distribution; chains past the MTP layers (Fixed(K + 1)), a tree past them."""
    target, _ = target_with_mtp(kind, mtp_layers, vocab=VOCAB)
    out = spec_ext.generate(target, "mtp", [PROMPT] * 20_000, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            eos_token_id=[], policy=policy or Fixed(mtp_layers + 1), seed=7)
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(temperature, top_k)))
    assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("policy", ["confidence", "svip", "adaptive"])
def test_length_policies_and_hf_settings_with_mtp_drafts(policy):
    """Confidence, SVIP and adaptive verification read the MTP drafts' confidences; greedy
    stays equal to ``target.generate`` on a ragged batch with EOS, and with HF's logits
    settings (applied to p and q alike) at batch 1."""
    target, _ = target_with_mtp("glm4_moe", 2)
    out = ragged_greedy_equals_target(target, "mtp", PROMPTS, policy, 16, range(4, 11))
    assert out.stats.accepted > 0
    prompt = PROMPTS[0]
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0, **settings)
    got = spec_ext.generate(target, "mtp", [prompt], max_new_tokens=16, eos_token_id=[], policy=policy, **settings)
    assert got.sequences[0].tolist() == expected[0].tolist()


# ---------------------------------------------------------------- the speculators mtp directory
class LibraryMtpLayer(torch.nn.Module):
    """The speculators 0.9.0 ``mtp`` layer as the library defines it (``MTPLayerMixin`` over
    a Qwen3 decoder layer), written here as the reference: ``final_layernorm(block(
    input_proj([token_layernorm(embed); hidden_layernorm(h)])))`` at the hidden state's own
    position, causal attention over the same step's earlier columns."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
        width, eps = config.hidden_size, config.rms_norm_eps
        self.block = Qwen3DecoderLayer(config, 0)
        self.hidden_layernorm, self.token_layernorm = Qwen3RMSNorm(width, eps), Qwen3RMSNorm(width, eps)
        self.input_proj = torch.nn.Linear(2 * width, width, bias=False)
        self.final_layernorm = Qwen3RMSNorm(width, eps)
        self.rotary = Qwen3RotaryEmbedding(config)
        self.width, self.vocab = width, config.vocab_size

    def forward(self, embeds, hidden):
        positions = torch.arange(hidden.shape[1])[None].expand(len(hidden), -1)
        x = self.input_proj(torch.cat([self.token_layernorm(embeds), self.hidden_layernorm(hidden)], -1))
        x = self.block(x, attention_mask=None, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.final_layernorm(x[0] if isinstance(x, tuple) else x)

    def library_state_dict(self):
        """The weight names the library saves (``mtp_layers.0.*``, the decoder layer's own at its
        top level; ``verifier_lm_head`` as it saves it, never loaded: NaN)."""
        state = {f"mtp_layers.0.{k.removeprefix('block.')}": v.detach().clone() for k, v in self.state_dict().items()
                 if not k.startswith("rotary")}
        state["verifier_lm_head.weight"] = torch.full((self.vocab, self.width), float("nan"))
        return state


def qwen3_target(path, vocab=61, seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    return transformers.Qwen3ForCausalLM.from_pretrained(path).eval()


def library_config(target, **changes):
    """config.json as speculators 0.9.0's ``MTPDraftModel.save_pretrained`` writes it."""
    config = {"architectures": ["MTPDraftModel"], "auto_map": {"": "config.MTPSpeculatorConfig"}, "dtype": "float32",
              "num_nextn_predict_layers": 1,
              "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                           "speculative_tokens": 3, "verifier_accept_k": 1}],
                                     "verifier": {"architectures": ["Qwen3ForCausalLM"],
                                                  "name_or_path": target.config.name_or_path}},
              "speculators_model_type": "mtp", "speculators_version": "0.9.0", "tie_word_embeddings": False,
              "transformer_layer_config": target.config.to_diff_dict(), "transformers_version": "5.19.0"}
    config.update(changes)
    return config


def write_library_mtp(path, target, layer, config=None, state=None):
    import json
    os.makedirs(path, exist_ok=True)
    save_file(state or layer.library_state_dict(), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or library_config(target), f, indent=2)


_LIBRARY: dict = {}


def library_mtp(vocab=61):
    """A tiny Qwen3 target and a speculators ``mtp`` directory for it, the layer trained a
    little (step 0 and the re-applied step 1, as the library's FastMTP loss) on the target's
    continuations: (target, directory, reference layer)."""
    if vocab not in _LIBRARY:
        transformers.logging.set_verbosity_error()
        root = scratch("mtp-speculators-")
        target = qwen3_target(os.path.join(root, "target"), vocab)
        torch.manual_seed(1)
        layer = LibraryMtpLayer(target.config).train()
        g = torch.Generator().manual_seed(2)
        embed = target.get_input_embeddings()
        with torch.no_grad():
            seqs = target.generate(torch.randint(3, vocab, (24, 4), generator=g), max_new_tokens=20, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
            h = target(seqs, output_hidden_states=True).hidden_states[-1]
        optimizer = torch.optim.Adam(layer.parameters(), lr=3e-3)
        n = seqs.shape[1] - 3
        for _ in range(60):
            optimizer.zero_grad()
            hidden, loss = h[:, :n], 0.0
            for step in range(2):
                hidden = layer(embed(seqs[:, step + 1:step + 1 + n]).detach(), hidden)
                logits = target.lm_head(hidden)
                loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                                seqs[:, step + 2:step + 2 + n].reshape(-1))
            loss.backward()
            optimizer.step()
        layer.eval()
        write_library_mtp(os.path.join(root, "mtp"), target, layer)
        _LIBRARY[vocab] = target, os.path.join(root, "mtp"), layer
    return _LIBRARY[vocab]


def test_a_speculators_mtp_directory_drafts_what_the_library_computes():
    """Loaded from the directory (``load``, what ``accelerate``/``--draft DIR`` call), the first
    round's draft distribution of every row of a ragged batch is the library layer's at the
    row's last hidden state (its step 0), and the MTP weights are the written ones."""
    from spec_ext.drafters import load
    target, path, layer = library_mtp()
    mtp = load(path, target)
    assert type(mtp).__name__ == "MtpModel" and mtp.embed_tokens is target.get_input_embeddings()
    written = layer.library_state_dict()
    renames = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
               "post_norm": "final_layernorm"}
    for name, tensor in mtp.layers[0].state_dict().items():
        head, _, rest = name.partition(".")
        theirs = f"mtp_layers.0.{renames[head]}.{rest}" if head in renames else f"mtp_layers.0.{rest}"
        assert torch.equal(tensor, written[theirs]), name
    sampled, _ = fresh_proposal(target, mtp, Fixed(1), PROMPTS, Sampler(1.0))
    for b, seq in enumerate(PROMPTS):
        with torch.no_grad():
            out = layer(target.get_input_embeddings()(torch.tensor([seq[1:]])), target_features(target, seq))
            expected = torch.softmax(target.lm_head(out)[0, -1].float(), -1)
        torch.testing.assert_close(sampled.q[b, 0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", [Fixed(4), "auto", DynamicTree(depth=3, top_k=2, nodes=6)])
def test_a_speculators_mtp_directory_greedy_equals_the_target(policy):
    target, path, _ = library_mtp()
    out = ragged_greedy_equals_target(target, path, PROMPTS, policy, 24, range(4, 11))
    assert out.stats.accepted > 0
    fast = spec_ext.accelerate(target, path, policy=policy)
    prompt = torch.tensor([PROMPTS[0]])
    assert torch.equal(fast.generate(prompt, max_new_tokens=12, eos_token_id=None, pad_token_id=0),
                       target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0))


def test_a_speculators_mtp_directory_round_trips_bit_equal(tmp_path):
    """Loaded and written again: the same tensors under the same names (the verifier's head,
    which the library saves unloaded, is not written), the same config."""
    import json
    from safetensors.torch import load_file
    from spec_ext.models.mtp import load_speculators_mtp, save_speculators_mtp
    target, path, _ = library_mtp()
    mtp = load_speculators_mtp(path, target)
    again = str(tmp_path / "again")
    save_speculators_mtp(mtp, again, target)
    mine, theirs = load_file(os.path.join(again, "model.safetensors")), load_file(os.path.join(path, "model.safetensors"))
    theirs.pop("verifier_lm_head.weight")
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    config = json.loads(open(os.path.join(again, "config.json")).read())
    expected = json.loads(open(os.path.join(path, "config.json")).read())
    expected.pop("transformers_version")
    assert config == expected
    reloaded = load_speculators_mtp(again, target)
    assert all(torch.equal(a, b) for a, b in zip(mtp.state_dict().values(), reloaded.state_dict().values()))
    glm, _ = target_with_mtp("glm4_moe", 2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers: .* has 2"):
        save_speculators_mtp(load_mtp(glm), str(tmp_path / "out"), glm)


@pytest.mark.parametrize("change,message", [
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers: 2"),
    (dict(num_centroids=64), "num_centroids: a speculators mtp field spec_ext does not know"),
    (dict(speculators_config={"algorithm": "eagle3"}), "speculators_config.algorithm: 'eagle3'"),
    ({"transformer_layer_config.hidden_size": 64}, r"transformer_layer_config.hidden_size: 64, but the target's is 32"),
    ({"transformer_layer_config.vocab_size": 99}, r"transformer_layer_config.vocab_size: 99, but the target's is 61"),
    ({"transformer_layer_config.num_hidden_layers": 3}, "transformer_layer_config.num_hidden_layers: 3"),
    ({"transformer_layer_config.model_type": "qwen2"}, "transformer_layer_config.model_type: 'qwen2', but the target"),
    ({"weights": "masked_embedding.centroids.weight"}, "weights spec_ext does not know .*masked_embedding"),
], ids=["layers", "centroids", "algorithm", "hidden", "vocab", "layer-count", "model-type", "weights"])
def test_a_speculators_mtp_directory_spec_ext_cannot_honour_is_refused_by_field(change, message, tmp_path):
    from spec_ext.drafters import load
    target, _, layer = library_mtp()
    config, state = library_config(target), layer.library_state_dict()
    for key, value in change.items():
        if key == "weights":
            state[value] = torch.zeros(4, 32)
        elif key.startswith("transformer_layer_config."):
            config["transformer_layer_config"][key.split(".", 1)[1]] = value
        else:
            config[key] = value
    write_library_mtp(str(tmp_path), target, layer, config, state)
    with pytest.raises(ValueError, match=message):
        load(str(tmp_path), target)


# ---------------------------------------------------------------- HF's logits settings and grammars
SETTINGS = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)


def hf_row(target, prompt, max_new, eos, **settings):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, **settings)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mtp_layers,policy", [(2, Fixed(4)), (2, "confidence"), (2, "svip"), (2, "auto"),
                                               (1, "tree"), (1, DynamicTree(depth=3, top_k=2, nodes=6))],
                         ids=["fixed", "confidence", "svip", "auto", "tree", "dynamic-tree"])
def test_hf_logits_settings_greedy_on_a_ragged_batch_with_eos(mtp_layers, policy):
    """repetition_penalty and no_repeat_ngram_size, applied to p and q alike: each row of a
    left-padded batch equals ``target.generate`` of its prompt alone with the same settings,
    an EOS ending row 0 early."""
    target, _ = target_with_mtp("glm4_moe", mtp_layers)
    free = hf_row(target, PROMPTS[0], 20, [], **SETTINGS)
    eos = next(free[i] for i in range(4, 11) if free[i] not in free[:i])
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in PROMPTS])[:, None]).long()
    out = spec_ext.generate(target, "mtp", ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                            pad_token_id=0, policy=policy, **SETTINGS)
    for b, prompt in enumerate(PROMPTS):
        expected = hf_row(target, prompt, 20, eos, **SETTINGS)
        got = out.sequences[b, L:].tolist()
        assert got == expected + [0] * (len(got) - len(expected)), f"row {b}"
    assert out.sequences[0, L:].tolist().index(eos) < 19
    assert out.stats.accepted > 0


@pytest.mark.parametrize("mtp_layers,policy,temperature,top_k,top_p",
                         [(2, Fixed(3), 1.0, None, 0.8), (1, DynamicTree(depth=2, top_k=2, nodes=4), 0.8, 5, 0.9)],
                         ids=["chain-top-p", "dynamic-tree-top-k-top-p"])
def test_top_k_top_p_sampling_follows_the_target_distribution(mtp_layers, policy, temperature, top_k, top_p):
    target, _ = target_with_mtp("glm4_moe", mtp_layers, vocab=VOCAB)
    out = spec_ext.generate(target, "mtp", [PROMPT] * 20_000, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_token_id=[], policy=policy, seed=11)
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(temperature, top_k, top_p)))
    assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("mtp_layers,policy", [(2, "fixed"), (2, "confidence"), (2, "svip"), (2, "auto"),
                                               (1, "tree"), (1, "dynamictree")])
def test_grammars_with_mtp_drafts_greedy_equal_hf(mtp_layers, policy):
    """Per-row grammars (a regex, a JSON schema, none) on a ragged batch with EOS, a one-token
    prompt among them: equal to ``target.generate`` with the grammar engine's masks as an HF
    processor (tests/test_grammar.py's oracle)."""
    from helpers import byte_tokenizer
    from spec_ext import Grammar
    from test_grammar import EOS, SCHEMA, LLGuidanceProcessor
    tokenizer = byte_tokenizer()
    target, _ = target_with_mtp("glm4_moe", mtp_layers, vocab=len(tokenizer) + 4)
    prompts = [[1, 70, 71], [1], [1, 80, 81, 82, 83]]
    grammars = [Grammar.regex("(ab|c)+b"), Grammar.json_schema(SCHEMA), None]
    L = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (L - len(p)) + p for p in prompts])
    mask = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in prompts])[:, None]).long()
    processor = LLGuidanceProcessor(grammars, tokenizer, target.config.vocab_size, L)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                               pad_token_id=EOS, logits_processor=[processor])
    fast = spec_ext.accelerate(target, "mtp", policy=policy)
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                        pad_token_id=EOS, tokenizer=tokenizer, grammar=grammars)
    assert torch.equal(got, expected)
    assert EOS in got[1, L:].tolist(), "the JSON object completes"
    assert fast.last_stats.accepted > 0


def test_the_cli_drafts_with_a_speculators_mtp_directory(tmp_path):
    """``python -m spec_ext generate --draft DIR``: a speculators mtp directory for the bundled
    target (a Llama-layer MTP, its block the target's last layer, written here in the library's
    layout) drafts, and the completion is the target's greedy one."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target_dir = Path(__file__).resolve().parents[1] / "models" / "stdlib-target"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    state = {f"mtp_layers.0.{k}": v.clone() for k, v in target.model.layers[-1].state_dict().items()}
    state.update({"mtp_layers.0.input_proj.weight": torch.cat([0.02 * torch.randn(H, H, generator=g), torch.eye(H)], 1),
                  **{f"mtp_layers.0.{n}.weight": torch.ones(H) for n in ("token_layernorm", "hidden_layernorm",
                                                                         "final_layernorm")}})
    config = library_config(target)
    config["speculators_config"]["verifier"] = {"architectures": ["LlamaForCausalLM"], "name_or_path": str(target_dir)}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = "import os\n\n\ndef read_config(path):\n"
    out = subprocess.run([sys.executable, "-m", "spec_ext", "generate", "--target", str(target_dir), "--draft",
                          str(tmp_path), "--prompt", prompt, "--max-new-tokens", "12", "--policy", "fixed"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(expected[0])
    assert out.stdout.startswith(text), (out.stdout, text)
    stats = json.loads(out.stdout[len(text):])
    assert stats["new_tokens"] == 12 and stats["drafted"] > 0


RAGGED = PROMPTS + [[12, 30, 44, 2, 19, 26, 33, 47, 5, 6, 58], [9]]  # left-padded to 11: one to ten pads


@pytest.mark.parametrize("source,policy", [(("glm4_moe", 1), Fixed(1)), (("glm4_moe", 2), Fixed(1)),
                                           (("glm4_moe", 2), Fixed(3)), (("deepseek_v3", 1), Fixed(2)),
                                           (("mellum", 1), Fixed(2)), (("step3p7", 2), Fixed(3)),
                                           ("speculators", Fixed(1)), ("speculators", Fixed(3)),
                                           ("speculators-hf-modules", Fixed(1))],
                         ids=["glm-1-layer", "glm-2-layers-fixed-1", "glm-2-layers-fixed-3", "mla-fixed-2",
                              "mellum-window-fixed-2", "step3p7-2-layers-fixed-3", "speculators-fixed-1",
                              "speculators-fixed-3", "speculators-hf-modules"])
def test_each_rows_drafts_in_a_ragged_batch_are_its_drafts_alone(source, policy):
    """Greedy, a ragged left-padded batch (a one-token prompt among them): every round's drafts
    of each row, and its per-row accepted and round counts, equal that row's generated alone
    (batch 1): the MTP layers' positions, cache, padded rows' hidden states and catch-up after
    commits do not depend on the other rows. Native MTP layers (position shift 1, 1 and 2
    layers; MoE targets: the HF modules) and a speculators directory (shift 0; a Qwen3 target:
    the lean forward and the lean MTP step, and both forced onto the HF modules)."""
    import contextlib
    from spec_ext.drafters import load
    from spec_ext.models.lean import hf_modules, why_not_lean
    if isinstance(source, str):
        target, path, _ = library_mtp()
        mtp = load(path, target)
        assert why_not_lean(target) is None
    else:
        target, _ = target_with_mtp(*source)
        mtp = load_mtp(target)
        assert why_not_lean(target) is not None
    forced = (lambda: hf_modules(target, mtp)) if source == "speculators-hf-modules" else contextlib.nullcontext

    def run(prompts):
        drafter = Recording(mtp)
        with forced():
            out = spec_ext.generate(target, drafter, prompts, max_new_tokens=14, eos_token_id=[], policy=policy)
        rounds = {i: [] for i in range(len(prompts))}
        for seqs, proposal in drafter.rounds:
            for b, seq in enumerate(seqs):
                row = next(i for i, p in enumerate(prompts) if seq[:len(p)] == p and len(seq) >= len(p))
                rounds[row].append(proposal.tokens[b, :int(proposal.num_draft[b])].tolist())
        return out, rounds

    batch, batch_rounds = run(RAGGED)
    assert 0 < batch.stats.accepted < batch.stats.drafted
    for i, prompt in enumerate(RAGGED):
        alone, alone_rounds = run([prompt])
        assert batch_rounds[i] == alone_rounds[0], i
        assert (batch.stats.row_accepted[i], batch.stats.row_rounds[i]) == \
            (alone.stats.row_accepted[0], alone.stats.row_rounds[0]), i
        assert batch.sequences[i, -14:].tolist() == alone.sequences[0, -14:].tolist(), i


# ---------------------------------------------------------------- the lean MTP step
def llama_with_mtp(mtp_layers: int, vocab: int = 61, seed: int = 0, **options):
    """A tiny random Llama target and ``mtp_layers`` random transformers ``MtpModel`` layers
    for it (Llama decoder blocks), in memory; ``options`` set on the target's config before
    the MTP model is built (``MtpModel``'s: ``mtp_hidden_states_first``, ...)."""
    from transformers import initialization
    from transformers.modeling_layers import MtpModel
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    target = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    target.config.num_mtp_layers = mtp_layers
    for name, value in options.items():
        setattr(target.config, name, value)
    with initialization.no_tie_weights():
        mtp = MtpModel(target, mtp_layers)
    with torch.no_grad():  # each layer mostly passes the hidden state on: drafts accepted and rejected
        for layer in mtp.layers:
            layer.mtp_block.load_state_dict(target.model.layers[-1].state_dict())
            parts = [0.3 * torch.randn(32, 32), torch.eye(32)]  # [embedding; hidden] unless the hidden state is first
            layer.eh_proj.weight.copy_(torch.cat(parts[::-1] if options.get("mtp_hidden_states_first") else parts, 1))
    return target, mtp.eval()


def test_which_mtp_layers_take_the_lean_step():
    """Llama and Qwen3 blocks take it (the drafter decides at start); glm4_moe's MoE block, a
    hooked layer and an MTP model forced with hf_modules do not, each with its reason."""
    from spec_ext.drafters import load
    from spec_ext.models.lean import hf_modules
    from spec_ext.models.mtp import why_not_lean_mtp
    llama, llama_mtp = llama_with_mtp(1)
    qwen3, path, _ = library_mtp()
    glm, _ = target_with_mtp("glm4_moe", 1)
    assert why_not_lean_mtp(llama_mtp) is None and why_not_lean_mtp(load(path, qwen3)) is None
    assert "unknown MTP block modules in Glm4MoeDecoderLayer" in why_not_lean_mtp(load_mtp(glm))
    with hf_modules(llama_mtp):
        assert "forced onto the HF modules" in why_not_lean_mtp(llama_mtp)
        drafter = MtpDrafter(llama_mtp)
        drafter.bind(llama)
        drafter.start([[5, 6, 7]], 16, Sampler())
        assert drafter.lean is None
    drafter.start([[5, 6, 7]], 16, Sampler())
    assert drafter.lean is not None
    hook = llama_mtp.layers[0].mtp_block.mlp.register_forward_hook(lambda *_: None)
    try:
        assert "forward hooks or a patched forward on layers.0.mtp_block.mlp" in why_not_lean_mtp(llama_mtp)
    finally:
        hook.remove()
    assert why_not_lean_mtp(llama_mtp) is None


@pytest.mark.parametrize("source", ["llama-2-layers", "speculators"])
@pytest.mark.parametrize("policy,temperature", [(Fixed(4), 0.0), (DynamicTree(4, 2, 8), 0.0), (Fixed(3), 1.0)],
                         ids=["chain-past-the-layers", "dynamic-tree", "sampled-chain"])
def test_the_lean_mtp_step_drafts_what_the_hf_modules_draft(source, policy, temperature):
    """On a ragged batch, every round's drafts and their q through the lean MTP step are
    bit-equal to the same drafter's on the HF modules (``hf_modules(mtp)``), and so are the
    outputs (greedy: equal to the target's)."""
    from spec_ext.drafters import load
    from spec_ext.models.lean import hf_modules
    if source == "speculators":
        target, path, _ = library_mtp()
        mtp = load(path, target)
    else:
        target, mtp = llama_with_mtp(2)
    for prompts in (RAGGED, [[9]]):  # alone, a one-token prompt's first round runs at index -1
        runs = []
        for forced in (False, True):
            drafter = Recording(mtp)
            with hf_modules(mtp) if forced else torch.no_grad():
                out = spec_ext.generate(target, drafter, prompts, max_new_tokens=12, eos_token_id=[],
                                        temperature=temperature, seed=5, policy=policy)
            assert (drafter.lean is None) == forced
            runs.append((out, drafter.rounds))
        (lean_out, lean_rounds), (hf_out, hf_rounds) = runs
        assert torch.equal(lean_out.sequences, hf_out.sequences)
        assert len(lean_rounds) == len(hf_rounds)
        for (seqs, mine), (_, theirs) in zip(lean_rounds, hf_rounds):
            assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.num_draft, theirs.num_draft)
            assert (mine.q is None) == (theirs.q is None) and (mine.q is None or torch.equal(mine.q, theirs.q))
        if prompts is RAGGED:
            assert 0 < lean_out.stats.accepted < lean_out.stats.drafted
        if temperature == 0.0:
            for i, prompt in enumerate(prompts):
                assert lean_out.sequences[i, -12:].tolist() == hf_greedy(target, prompt, 12, eos=[])


# Inkling's MtpModel options (its target is refused: test_architectures_spec_ext_cannot_decode_are_refused_by_name)
OPTIONS = dict(mtp_hidden_states_first=True, chain_hidden_post_norm=True, logits_mup_width_multiplier=2.0,
               unpadded_vocab_size=57)


def test_mtp_model_options_are_honoured_on_both_paths():
    """``MtpModel``'s options (Inkling's checkpoints use them): the projection reads [hidden;
    embedding], one shared post-norm after every layer instead of each layer's, the head's
    input divided by the muP width multiplier, logits cut to the unpadded vocabulary. On a
    2-layer Llama MTP, through the lean step and the HF modules: a ragged batch's first K
    greedy drafts and q equal ``MtpModel.forward``'s (q 0 past the unpadded vocabulary), and
    greedy decoding equals the target's."""
    from transformers.cache_utils import MtpCache
    from spec_ext.models.lean import hf_modules
    target, mtp = llama_with_mtp(2, **OPTIONS)
    assert mtp.use_shared_post_norm and not mtp.use_post_norm
    V = OPTIONS["unpadded_vocab_size"]
    expected = []
    for b, seq in enumerate(PROMPTS):
        with torch.no_grad():
            drafts, logits, _ = mtp(input_ids=torch.tensor([seq[1:]]), last_hidden_states=target_features(target, seq),
                                    attention_mask=None, position_ids=torch.arange(1, len(seq))[None],
                                    mtp_cache=MtpCache(config=target.config.get_mtp_config()), do_sample=False)
        assert logits.shape[-1] == V
        expected.append((drafts[0], torch.softmax(logits[0].float(), -1)))
    for forced in (False, True):
        with hf_modules(mtp) if forced else torch.no_grad():
            greedy, drafter = fresh_proposal(target, mtp, Fixed(2), PROMPTS)
            assert (drafter.lean is None) == forced
            sampled, _ = fresh_proposal(target, mtp, Fixed(2), PROMPTS, Sampler(1.0))
            for b, (drafts, probs) in enumerate(expected):
                assert greedy.tokens[b].tolist() == drafts.tolist()
                torch.testing.assert_close(greedy.confidence[b], probs.gather(1, drafts[:, None])[:, 0], rtol=1e-5,
                                           atol=1e-6)
                torch.testing.assert_close(sampled.q[b, 0, :V], probs[0], rtol=1e-5, atol=1e-6)
                assert sampled.q.shape[-1] == 61 and not sampled.q[b, 0, V:].any()
            out = ragged_greedy_equals_target(target, MtpDrafter(mtp), PROMPTS, Fixed(3), 16, range(4, 11))
            assert out.stats.accepted > 0


@pytest.mark.parametrize("policy", ["auto", "fixed", Tree((2, 1))])
@pytest.mark.parametrize("step", ["hf modules", "lean"])
def test_four_threads_calling_one_mtp_accelerated_model_each_get_their_own_output(step, policy):
    """MTP layers loaded once (``accelerate(target, "mtp")``: glm4_moe's through the HF modules;
    a speculators directory for Qwen3, the lean step), ragged greedy calls on four threads at
    once: each equals the target's greedy output, as the same call made alone."""
    from test_concurrency import left_padded, run_at_once
    if step == "lean":
        target, draft, _ = library_mtp()
    else:
        (target, _), draft = target_with_mtp("glm4_moe", 2), "mtp"
    fast = spec_ext.accelerate(target, draft, policy=policy)
    batches = [PROMPTS, PROMPTS[1:], PROMPTS[:1], PROMPTS[::2]]
    expected = [[hf_greedy(target, p, 12, eos=[]) for p in batch] for batch in batches]

    def call(batch):
        ids, mask = left_padded(batch)
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[],
                            pad_token_id=0)
        return [row[-12:].tolist() for row in out]

    assert run_at_once([lambda b=batch: call(b) for batch in batches]) == expected
