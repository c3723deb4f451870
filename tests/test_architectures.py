"""Every decoder-only architecture the issue lists, on tiny random configs made here (fp32,
CPU, nothing downloaded): greedy output equals ``target.generate`` on a ragged left-padded
batch with EOS, past every sliding window; sampling follows the target's exact
distribution for one model of each attention kind (plain, window, softcap, sinks, MoE);
vocabularies that differ by padding decode exactly; what cannot work is refused by name."""
import pytest
import torch
import transformers

import spec_ext
from spec_ext.engine import Sampler
from spec_ext.models import SpecCache, forward_path, hf, unsupported_reason
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy, perturbed, ragged_greedy_equals_target

WINDOW = 6  # sliding-window layers: the prompts plus new tokens run well past it
CLASSES = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3",
           "qwen3_moe": "Qwen3Moe", "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3", "phi3": "Phi3",
           "granite": "Granite", "olmo2": "Olmo2", "smollm3": "SmolLM3", "starcoder2": "Starcoder2",
           "gpt_neox": "GPTNeoX", "gpt2": "GPT2", "gpt_oss": "GptOss",
           # the architectures whose configs carry MTP layers (num_mtp_layers) and attend through the interface
           "glm4_moe": "Glm4Moe", "deepseek_v3": "DeepseekV3", "ernie4_5_moe": "Ernie4_5_Moe", "mellum": "Mellum",
           "solar_open": "SolarOpen", "youtu": "Youtu", "axk1": "AXK1"}
ARCHITECTURES = sorted(CLASSES)


def sharpened_model(kind: str, vocab: int = 61, seed: int = 0, window: int = WINDOW, **overrides):
    """A 2-layer random ``kind`` model with sharpened weights (clear argmaxes); its attention
    features: windows on mistral, starcoder2, gemma2/3 and gpt_oss (gemma3 and gpt_oss
    alternate sliding and full layers), a soft-cap on gemma2, sinks on gpt_oss, experts on
    mixtral, qwen3_moe and gpt_oss, and on the MTP families (glm4_moe, deepseek_v3, ernie4_5_moe,
    solar_open, axk1); MLA (deepseek_v3, youtu, axk1: keys 16 wide, values 8, a cached latent)."""
    config = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    alternating = ["sliding_attention", "full_attention"]
    deepseek_moe = dict(moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1)
    mla = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
               v_head_dim=8)
    extra = {"mistral": dict(sliding_window=window), "starcoder2": dict(sliding_window=window),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
             "qwen3": dict(head_dim=8), "gemma": dict(head_dim=8),
             "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
             "gemma2": dict(head_dim=8, sliding_window=window, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                            final_logit_softcapping=5.0),
             "gemma3": dict(head_dim=8, sliding_window=window, query_pre_attn_scalar=8, layer_types=alternating),
             "smollm3": dict(no_rope_layer_interval=2),
             "gpt_oss": dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                             layer_types=alternating),
             "glm4_moe": dict(head_dim=8, **deepseek_moe), "solar_open": dict(head_dim=8, **deepseek_moe),
             "deepseek_v3": dict(**mla, **deepseek_moe), "youtu": dict(mla),
             "axk1": dict(mla, q_lora_rank=16, **deepseek_moe),
             "ernie4_5_moe": dict(head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=24,
                                  moe_layer_start_index=1),
             "mellum": dict(head_dim=8)}
    config.update(extra.get(kind, {}))
    if kind == "gpt_neox":
        del config["num_key_value_heads"]
    if kind == "gpt2":
        config = dict(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    config.update(overrides)
    prefix = CLASSES[kind]
    config_class = getattr(transformers, prefix + ("TextConfig" if kind == "gemma3" else "Config"))
    model_class = getattr(transformers, prefix + ("LMHeadModel" if kind == "gpt2" else "ForCausalLM"))
    torch.manual_seed(seed)
    model = model_class(config_class(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


_PAIRS: dict = {}


def pair(kind: str):
    """One shared (target, perturbed copy as draft) per architecture for the whole module."""
    if kind not in _PAIRS:
        target = sharpened_model(kind)
        _PAIRS[kind] = target, perturbed(target, 0.01, seed=1)
    return _PAIRS[kind]


PROMPTS = [[5, 17, 33, 8, 9, 10, 11], [40, 3], [7, 21, 50, 4]]
NEW = 24
EOS_STEPS = range(4, 11)  # row 0 ends by step 10 (at once where its continuation repeats its first token)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_greedy_ragged_batch_with_eos_equals_target_generate(kind):
    target, draft = pair(kind)
    assert unsupported_reason(target) is None
    out = ragged_greedy_equals_target(target, draft, PROMPTS, "fixed", NEW, EOS_STEPS)
    assert out.stats.accepted > 0, "the perturbed copy should agree with the target sometimes"
    expected_path = "lean" if kind in ("llama", "mistral", "qwen2", "qwen3") else "hf"
    assert forward_path(target).split(":")[0] == expected_path


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox"])
def test_a_stray_num_key_value_heads_is_ignored_as_the_architecture_ignores_it(kind):
    """GPT-2 and GPT-NeoX attend with every head whatever ``num_key_value_heads`` a saved
    config carries (HF's own cache holds 4 heads): spec_ext decodes them as HF does."""
    target = sharpened_model(kind, num_key_value_heads=2)
    assert target.config.num_key_value_heads == 2 and target.config.num_attention_heads == 4
    with torch.no_grad():
        hf_cache = target(torch.tensor([PROMPTS[0]]), use_cache=True).past_key_values
    assert hf_cache.layers[0].keys.shape[1] == 4
    draft = perturbed(target, 0.01, seed=1)
    for policy in ("fixed", "tree"):
        assert ragged_greedy_equals_target(target, draft, PROMPTS, policy, NEW, EOS_STEPS).stats.accepted > 0


@pytest.mark.parametrize("policy", ["fixed", "tree", "ngram"])
def test_learned_positions_can_be_filled_to_the_last(policy):
    """GPT-2's positions are a table of max_position_embeddings rows: a prompt plus
    max_new_tokens may fill it (HF's generate allows that), although the last rounds verify
    drafts past it (their tokens are cut; their positions are kept in range), and a draft
    with a shorter table than the target's proposes past its own end."""
    target = sharpened_model("gpt2", n_positions=16)
    draft = None if policy == "ngram" else perturbed(sharpened_model("gpt2", n_positions=10), 0.01, seed=1)
    prompt = [5, 17, 33, 5, 17, 33]
    out = spec_ext.generate(target, draft, [prompt], max_new_tokens=16 - len(prompt), eos_token_id=[],
                            policy=policy)
    assert out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 16 - len(prompt), eos=[])


def test_models_the_lean_forward_knows_can_be_kept_on_the_hf_modules():
    target, draft = pair("qwen3")
    with spec_ext.models.hf_modules(target, draft):
        ragged_greedy_equals_target(target, draft, PROMPTS, "fixed", NEW, EOS_STEPS)
        assert forward_path(target) == forward_path(draft) == \
            "hf: forced onto the HF modules (spec_ext.models.hf_modules)"
    ragged_greedy_equals_target(target, draft, PROMPTS, "fixed", 12, EOS_STEPS)
    assert forward_path(target) == forward_path(draft) == "lean"


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_greedy_tree_policy_past_the_window(kind):
    """Tree verification: node positions (prefix + depth) decide what the window shows."""
    target, draft = pair(kind)
    ragged_greedy_equals_target(target, draft, PROMPTS, "tree", NEW, EOS_STEPS)


# ---------------------------------------------------------------- exact distributions
SAMPLING_KINDS = {"plain": ("llama", {}), "window": ("mistral", dict(window=2)),
                  "softcap": ("gemma2", dict(window=64)), "sinks": ("gpt_oss", dict(window=2)),
                  "moe": ("qwen3_moe", {}), "mla": ("deepseek_v3", {})}


@pytest.mark.parametrize("attention", SAMPLING_KINDS)
def test_sampling_follows_the_target_distribution(attention):
    """The first 3 tokens after a 3-token prompt, 20,000 rows, against the enumerated joint
    distribution; a window of 2 is passed by the second new token."""
    kind, options = SAMPLING_KINDS[attention]
    target = sharpened_model(kind, vocab=VOCAB, seed=10, **options)
    draft = perturbed(target, 0.05, seed=11)
    out = spec_ext.generate(target, draft, [PROMPT] * 20_000, max_new_tokens=3, temperature=1.0, eos_token_id=[],
                            policy="fixed", seed=7)
    assert_follows(out.sequences[:, len(PROMPT):].numpy(), exact_joint(target, Sampler(1.0)))
    assert out.stats.accepted > 0


# ---------------------------------------------------------------- padded vocabularies
def resized(model, rows: int, seed: int):
    """A perturbed copy of ``model`` whose vocabulary (embeddings and head) has ``rows`` rows:
    truncated, or padded with new rows (as checkpoints pad one tokenizer's table)."""
    draft = perturbed(model, 0.01, seed)
    draft.resize_token_embeddings(rows, mean_resizing=False)
    if draft.get_output_embeddings().weight.shape[0] != rows:  # an untied head
        head = draft.get_output_embeddings()
        weight = torch.randn(rows, head.weight.shape[1]) * head.weight.std()
        weight[:min(rows, head.weight.shape[0])] = head.weight[:rows]
        draft.set_output_embeddings(torch.nn.Linear(head.weight.shape[1], rows, bias=False))
        draft.get_output_embeddings().weight.data = weight
    draft.config.vocab_size = rows
    return draft


# the lean forward (llama) and the HF modules (gpt2); a draft that lacks the target's last
# rows (53 of 61) or has extra ones (64); the serial engine and the parallel one
PADDED_CASES = [(kind, rows, policy) for kind in ("llama", "gpt2") for rows in (53, 64) for policy in ("fixed", "tree")]
PADDED_CASES += [("llama", 53, "pearl"), ("gpt2", 64, "pearl"), ("llama", 53, "specbranch")]


@pytest.mark.parametrize("kind,rows,policy", PADDED_CASES)
def test_padded_vocabulary_greedy_equals_target_generate(kind, rows, policy):
    target, _ = pair(kind)
    draft = resized(target, rows, seed=2)
    out = ragged_greedy_equals_target(target, draft, PROMPTS, policy, NEW, EOS_STEPS)
    assert out.stats.accepted > 0
    if rows < 61:  # the target emits tokens the draft cannot embed: it is fed a placeholder
        assert (out.sequences >= rows).any()


@pytest.mark.parametrize("rows,temperature,top_k", [(6, 1.0, None), (11, 0.6, 5)])
def test_padded_vocabulary_sampling_follows_the_target_distribution(rows, temperature, top_k):
    """V=8 target; the draft lacks tokens 6 and 7 (never proposes them, gets a placeholder
    for them) or has 3 extra rows (dropped: its q is renormalised over the target's 8)."""
    target = sharpened_model("llama", vocab=VOCAB, seed=10)
    draft = resized(target, rows, seed=11)
    out = spec_ext.generate(target, draft, [PROMPT] * 20_000, max_new_tokens=3, temperature=temperature,
                            top_k=top_k, eos_token_id=[], policy="fixed", seed=8)
    samples = out.sequences[:, len(PROMPT):]
    assert_follows(samples.numpy(), exact_joint(target, Sampler(temperature, top_k)))
    assert out.stats.accepted > 0
    if rows < VOCAB:
        assert (samples[:, :2] >= rows).any()  # fed back to the draft as a placeholder


def test_padded_logits_have_the_targets_width_and_zero_probability():
    target, draft = pair("llama")
    short, long = resized(target, 53, seed=3), resized(target, 64, seed=4)
    ids = torch.tensor([[5, 60, 58]])  # 58 and 60: past the short draft's rows
    with torch.inference_mode():
        for model in (short, long):
            with hf.attention_implementation(model, vocab_size=61):
                logits = hf.forward(model, ids, SpecCache.for_model(model, 1, 8), torch.arange(3)[None]).logits
            assert logits.shape == (1, 3, 61) and torch.isfinite(logits).all()
        assert Sampler(0.7).probs(logits)[..., 53:].sum() > 0  # the long draft's columns are its own
        with hf.attention_implementation(short, vocab_size=61):
            logits = hf.forward(short, ids, SpecCache.for_model(short, 1, 8), torch.arange(3)[None]).logits
        assert torch.equal(Sampler(0.7).probs(logits)[..., 53:], torch.zeros(1, 3, 8))
        assert (logits.argmax(-1) < 53).all()
        placeholder = torch.tensor([[5, 0, 0]])  # the short draft's pad id stands in
        with hf.attention_implementation(short, vocab_size=61):
            a = hf.forward(short, ids, SpecCache.for_model(short, 1, 8), torch.arange(3)[None]).logits
            b = hf.forward(short, placeholder, SpecCache.for_model(short, 1, 8), torch.arange(3)[None]).logits
        assert torch.equal(a, b)


def test_a_draft_that_is_almost_never_accepted_is_named_as_the_likely_cause():
    target, _ = pair("llama")
    stranger = sharpened_model("llama", seed=5)  # as if it used another tokenizer
    with pytest.warns(UserWarning, match=r"draft: \d+ of \d+ drafts accepted.*another tokenizer"):
        spec_ext.generate(target, stranger, [[5, 6, 7]], max_new_tokens=40, eos_token_id=[], policy="fixed")


# ---------------------------------------------------------------- refusals
def test_refused_models_name_the_reason():
    cases = []
    cases.append((transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=61, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2)), "an encoder-decoder model"))
    cases.append((transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=61, hidden_size=16, state_size=4, num_hidden_layers=1)), "recurrent or state-space layers"))
    cases.append((transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=61, hidden_size=16, n_layer=1, n_head=2)),
        "its attention layers do not call transformers' attention interface"))
    bidirectional = sharpened_model("gemma3", use_bidirectional_attention=True)
    cases.append((bidirectional, r"use_bidirectional_attention=True \(is_causal=False\)"))
    for name in ("KimiLinear", "BailingHybrid"):  # linear attention (BailingHybrid: with MTP layers)
        cases.append((getattr(transformers, name + "ForCausalLM")(getattr(transformers, name + "Config")(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0)), r"recurrent or state-space layers \('linear_attention' layers\)"))
    hybrid = sharpened_model("llama")
    hybrid.config.layer_types = ["full_attention", "linear_attention"]
    cases.append((hybrid, r"recurrent or state-space layers \('linear_attention' layers\)"))
    chunked = sharpened_model("llama")
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    cases.append((chunked, r"layer type 'chunked_attention'"))

    class NoCache(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask)

    cases.append((NoCache(sharpened_model("llama").config), "its forward takes no cache"))
    draft = pair("llama")[1]
    for model, reason in cases:
        with pytest.raises(ValueError, match=f"target: {type(model).__name__} .*is not supported: {reason}"):
            spec_ext.generate(model, draft, [[1, 2]], max_new_tokens=2)
        with pytest.raises(ValueError, match=f"draft: {type(model).__name__} .*is not supported: {reason}"):
            spec_ext.accelerate(draft, model)


def test_attention_arguments_it_cannot_apply_are_refused_by_name():
    target, _ = pair("llama")
    module = target.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4, 8)
    mask, lengths = torch.zeros(1, 1, 2, 0, dtype=torch.int32), torch.tensor([2])
    attention = transformers.AttentionInterface()["spec_ext"]
    out, _ = attention(module, q, k, k, mask, scaling=0.5, position_ids=None, use_cache=True, spec_prefix_lens=lengths)
    assert out.shape == (1, 2, 4, 8)
    for kwargs, name in ((dict(alibi=torch.zeros(4)), "the attention argument 'alibi'"),
                         (dict(dropout=0.1), r"dropout=0.1 \(the model is in train mode\)"),
                         (dict(is_causal=False), "is_causal=False")):
        with pytest.raises(ValueError, match=f"LlamaAttention: {name}"):
            attention(module, q, k, k, mask, spec_prefix_lens=lengths, **kwargs)
    with pytest.raises(RuntimeError, match="got a mask transformers built"):
        attention(module, q, k, k, torch.zeros(1, 1, 2, 4), spec_prefix_lens=lengths)
