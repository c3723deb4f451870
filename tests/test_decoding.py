"""The loop end to end on tiny random-weight models (fp32, CPU): greedy output equals the
target's own greedy generate; sampled output follows the target's exact distribution."""
import copy
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import BloomConfig, BloomForCausalLM

import spec_ext
from spec_ext.engine import Sampler
from spec_ext.policies import POLICIES, Auto
from helpers import (CollectingStreamer, PROMPT, VOCAB, assert_follows, eagle2_paths, exact_joint, hf_greedy, llama,
                     make_policy, perturbed, ragged_greedy_equals_target, tree_paths)

POLICY_NAMES = sorted(POLICIES)


@pytest.fixture(scope="module")
def greedy_pair():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_greedy_batch1_equals_target(greedy_pair, policy):
    target, draft = greedy_pair
    prompt = [5, 17, 33, 8]
    expected = hf_greedy(target, prompt, 40, eos=[])
    out = spec_ext.generate(target, draft, [prompt], max_new_tokens=40, eos_token_id=[],
                            policy=make_policy(policy, target, draft))
    assert out.sequences[0, len(prompt):].tolist() == expected
    assert out.stats.new_tokens == 40 and out.stats.target_calls <= 40
    if policy != "plain":  # (Plain drafts nothing)
        assert out.stats.accepted > 0, "the perturbed draft should agree with the target sometimes"


@pytest.mark.parametrize("policy", ["fixed", "tree", "pearl"])
def test_greedy_with_fast_linear_equals_target(greedy_pair, policy):
    """The skinny-GEMM forward rounds differently from HF's, but not enough to change these
    greedy continuations (an exact tie within float32 rounding could)."""
    target, draft = greedy_pair
    prompts = [[5, 17, 33, 8], [40, 2]]
    out = spec_ext.generate(target, draft, prompts, max_new_tokens=40, eos_token_id=[], policy=policy,
                            fast_linear=True)
    for b, prompt in enumerate(prompts):
        assert out.sequences[b, -40:].tolist() == hf_greedy(target, prompt, 40, eos=[]), f"row {b}"


def test_the_draft_takes_the_skinny_kernel_and_the_target_stays_exact(greedy_pair):
    """With fast_linear=False the target keeps HF's linear (bit-equal logits) and the draft
    takes skinny_linear where it applies, silently; fast_linear=True puts both on it."""
    from spec_ext.models.lean import lean_decoder
    target, draft = greedy_pair
    aten = torch.nn.functional.linear
    applies = spec_ext.ops.linear.kernel_applies(draft.device, draft.dtype)  # AVX-512 here?
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec_ext.generate(target, draft, [[5, 17]], max_new_tokens=4, eos_token_id=[], policy="fixed",
                          fast_linear=False)
    assert lean_decoder(target).linear is aten
    assert lean_decoder(draft).fast_linear == applies
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without AVX-512 says fast_linear cannot apply
        spec_ext.generate(target, draft, [[5, 17]], max_new_tokens=4, eos_token_id=[], policy="fixed",
                          fast_linear=True)
    assert (lean_decoder(target).linear is not aten) == applies == (lean_decoder(draft).linear is not aten)
    bf16_draft = copy.deepcopy(draft).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" falls back without a word
        with spec_ext.models.attention_implementation(target, bf16_draft, fast_linear=[False, "auto"]):
            assert lean_decoder(bf16_draft).linear is aten
    with pytest.raises(ValueError, match="fast_linear: 1 settings for 2 models"):
        with spec_ext.models.attention_implementation(target, draft, fast_linear=[True]):
            pass
    with pytest.raises(ValueError, match="fast_linear: expected 'auto', True or False, got 'yes'"):
        spec_ext.generate(target, draft, [[5, 17]], max_new_tokens=4, policy="fixed", fast_linear="yes")
    with pytest.raises(ValueError, match="fast_linear: expected 'auto', True or False, got 2"):
        spec_ext.accelerate(target, draft, policy="fixed", fast_linear=2)
    with pytest.raises(ValueError, match="fast_linear: expected False, True or 'auto', got 2"):
        spec_ext.models.lean.prepare(draft, fast_linear=2)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_greedy_ragged_batch_with_eos_equals_target(greedy_pair, policy):
    target, draft = greedy_pair
    prompts = [[5, 17, 33, 8], [40], [9, 9, 9, 9, 9, 9, 9, 12], [70, 71]]
    ragged_greedy_equals_target(target, draft, prompts, make_policy(policy, target, draft))


def test_accelerate_is_a_drop_in_for_generate(greedy_pair):
    target, draft = greedy_pair
    fast = spec_ext.accelerate(target, draft, policy="fixed")
    ids = torch.tensor([[5, 17, 33, 8]])
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = fast.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected) and got.shape[1] == 4 + 12
    assert fast.config is target.config and fast.last_stats.target_calls > 0
    # an EOS the target emits mid-way: both stop there, the output is cut short
    free_run = expected[0, 4:].tolist()
    stop = next(i for i, t in enumerate(free_run) if i >= 3 and t not in free_run[:i])
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=free_run[stop])
    got = fast.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=free_run[stop])
    assert torch.equal(got, expected) and got.shape[1] == 4 + stop + 1 < 4 + 12
    with pytest.raises(ValueError, match="num_beams: not supported"):
        fast.generate(ids, num_beams=4)


def test_accelerated_generate_samples_as_the_generation_config_says(greedy_pair):
    """do_sample, temperature, top_k and top_p come from the target's generation_config
    unless given: each run equals spec_ext.generate with those settings and the same seed."""
    target, draft = (copy.deepcopy(m) for m in greedy_pair)
    fast = spec_ext.accelerate(target, draft, policy="fixed")
    ids = torch.tensor([[3, 4, 5]] * 6)
    config = target.generation_config
    greedy = fast.generate(ids, max_new_tokens=10, eos_token_id=[], pad_token_id=0)
    assert torch.equal(greedy, spec_ext.generate(target, draft, ids, max_new_tokens=10, eos_token_id=[],
                                                 policy="fixed").sequences)
    runs = {}
    for settings in [dict(temperature=1.0, top_k=None, top_p=None), dict(temperature=0.5, top_k=None, top_p=None),
                     dict(temperature=1.0, top_k=3, top_p=None), dict(temperature=1.0, top_k=None, top_p=0.6)]:
        config.do_sample, config.temperature, config.top_k, config.top_p = True, *settings.values()
        got = fast.generate(ids, max_new_tokens=10, eos_token_id=[], pad_token_id=0, seed=4)
        expected = spec_ext.generate(target, draft, ids, max_new_tokens=10, eos_token_id=[], policy="fixed",
                                     seed=4, **settings).sequences
        assert torch.equal(got, expected), settings
        runs[tuple(settings.values())] = got
    assert len({tuple(run.flatten().tolist()) for run in [greedy, *runs.values()]}) == 5, "settings were ignored"
    # an argument wins over the config
    got = fast.generate(ids, max_new_tokens=10, eos_token_id=[], pad_token_id=0, seed=4, top_p=1.0)
    assert torch.equal(got, runs[1.0, None, None])
    config.do_sample = False
    assert torch.equal(fast.generate(ids, max_new_tokens=10, eos_token_id=[], pad_token_id=0, seed=4), greedy)


def test_different_seeds_give_different_samples(greedy_pair):
    target, draft = greedy_pair
    a, b = (spec_ext.generate(target, draft, [[3, 4, 5]] * 4, max_new_tokens=16, temperature=1.0, seed=seed,
                              policy="fixed").sequences for seed in (1, 2))
    assert not torch.equal(a, b)


def test_stats_count_by_source_and_as_dict_keeps_the_keys():
    """Rounds are counted by what drafted them (one table); the text's keys add up the row's own
    text and the suffix cache, the cache's keys the cache alone."""
    import json
    from spec_ext.engine import Stats
    stats = Stats(target_calls=5, draft_calls=12, new_tokens=21, discarded=2, wall_time=0.123456,
                  processing_time=0.012345, row_rounds=[0, 0], row_drafted=[0, 0], row_accepted=[0, 0])
    for row, source, drafted, accepted in [(0, "model", 3, 2), (0, "text", 4, 1), (1, "cache", 4, 3), (0, "model", 3, 3),
                                           (1, "text", 3, 0), (0, "model", 3, 2), (1, "none", 0, 0), (0, "none", 0, 0)]:
        stats.count(row, source, drafted, accepted)
    assert stats.as_dict() == dict(target_calls=5, draft_calls=12, rounds=8, drafted=20, accepted=11,
                                   rollback=20 - 11 + 2, mean_accepted=1.375, acceptance_rate=0.55, discarded=2,
                                   new_tokens=21, wall_time=0.1235, processing_time=0.0123, tokenizer_mode="",
                                   tokens_per_s=round(21 / 0.123456, 2), matched=3, text_drafted=11, text_accepted=4,
                                   cache_matched=1, cache_drafted=4, cache_accepted=3,
                                   by_source=dict(model=dict(rounds=3, drafted=9, accepted=7),
                                                  text=dict(rounds=2, drafted=7, accepted=1),
                                                  cache=dict(rounds=1, drafted=4, accepted=3),
                                                  none=dict(rounds=2, drafted=0, accepted=0)),
                                   per_row=dict(rounds=[5, 3], matched=[1, 2], drafted=[13, 7], accepted=[8, 3],
                                                cache_matched=[0, 1]))
    json.dumps(stats.as_dict())  # what the CLI prints
    assert Stats().as_dict()["mean_accepted"] == 0.0 and Stats().as_dict()["acceptance_rate"] == 0.0


def test_seed_makes_sampling_reproducible(greedy_pair):
    target, draft = greedy_pair
    runs = [spec_ext.generate(target, draft, [[3, 4, 5]] * 4, max_new_tokens=16, temperature=1.0, seed=7,
                              policy="svip").sequences for _ in range(2)]
    assert torch.equal(*runs)
    torch.manual_seed(3)
    a = spec_ext.generate(target, draft, [[3, 4, 5]] * 4, max_new_tokens=16, temperature=1.0).sequences
    torch.manual_seed(3)
    b = spec_ext.generate(target, draft, [[3, 4, 5]] * 4, max_new_tokens=16, temperature=1.0).sequences
    assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["auto", "plain"])
def test_streamer_receives_every_token(greedy_pair, policy):
    target, draft = greedy_pair

    streamer = CollectingStreamer()
    out = spec_ext.generate(target, draft, [[5, 6]], max_new_tokens=10, eos_token_id=[], streamer=streamer,
                            policy=policy)
    assert streamer.ended and sum(streamer.chunks, []) == out.sequences[0].tolist()
    assert out.sequences.shape[1] == 12


# ------------------------------------------------------------------- exact distribution


@pytest.fixture(scope="module")
def sampling_models():
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    return target, {"near": perturbed(target, 0.01, seed=11), "far": llama(VOCAB, 32, 1, seed=12, sharpen=3.0)}


SAMPLING_CASES = [(policy, 1.0, None, None, "near") for policy in POLICY_NAMES]
SAMPLING_CASES += [(policy, 0.7, 5, None, "near") for policy in POLICY_NAMES]
SAMPLING_CASES += [("fixed", 1.0, None, None, "far"), ("tree", 0.7, 5, None, "far"), ("svip", 1.0, None, None, "far")]
SAMPLING_CASES += [("fixed", 1.0, None, 0.8, "near"), ("auto", 1.0, 6, 0.7, "far")]


@pytest.mark.parametrize("policy,temperature,top_k,top_p,draft_name", SAMPLING_CASES)
def test_sampling_follows_target_distribution(sampling_models, policy, temperature, top_k, top_p, draft_name,
                                              monkeypatch):
    target, drafts = sampling_models
    n = 20_000
    draft = drafts[draft_name]
    # at 20,000 rows of these models a plain step beats drafts accepted 9 times in 10: Auto (and
    # Suffix beside a model, Auto's round) would draft nothing; here they draft until measured
    monkeypatch.setattr(Auto, "OPTIMISTIC", None)
    out = spec_ext.generate(target, draft, [PROMPT] * n, max_new_tokens=3, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_token_id=[], policy=make_policy(policy, target, draft),
                            seed=sum(map(ord, policy)) + int(10 * temperature))
    samples = out.sequences[:, len(PROMPT):].numpy()
    joint = exact_joint(target, Sampler(temperature, top_k, top_p))
    if top_p is not None:
        assert sum(p == 0 for p in joint.values()) > 0, "top_p cut nothing here"
    assert_follows(samples, joint)
    if draft_name == "near" and policy != "plain":  # (Plain drafts nothing)
        assert out.stats.accepted > 0


# ------------------------------------------------------------------------ bad input
def test_bad_input(greedy_pair):
    target, draft = greedy_pair
    with pytest.raises(ValueError, match="input_ids: prompt 1 is empty"):
        spec_ext.generate(target, draft, [[1, 2], []])
    with pytest.raises(ValueError, match="max_new_tokens: must be a positive int"):
        spec_ext.generate(target, draft, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings"):
        spec_ext.generate(target, draft, [[1] * 250], max_new_tokens=10)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=97, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="target: BloomForCausalLM .* not supported: its attention layers do not"):
        spec_ext.generate(bloom, draft, [[1, 2]])
    with pytest.raises(ValueError, match="policy: expected a Policy"):
        spec_ext.generate(target, draft, [[1, 2]], policy="nonsense")
    with pytest.raises(ValueError, match="temperature: must be >= 0"):
        spec_ext.generate(target, draft, [[1, 2]], temperature=-1.0)
    with pytest.raises(ValueError, match="streamer: supported for batch size 1"):
        spec_ext.generate(target, draft, [[1, 2], [3]], streamer=object())


def test_a_token_id_past_the_vocabulary_is_refused_naming_input_ids_the_id_and_the_size(greedy_pair):
    target, draft = greedy_pair
    with pytest.raises(IndexError):  # what the target's own forward does with it
        target(torch.tensor([[5, 97]]))
    for ids, mask, bad in ((torch.tensor([[5, 97]]), None, 97),
                           (torch.tensor([[120, 5, 6]]), torch.tensor([[1, 1, 1]]), 120), ([[5, 6], [7, -1]], None, -1)):
        with pytest.raises(ValueError, match=rf"input_ids: prompt \d has token id {bad}, outside the target's "
                                             rf"vocabulary of 97 ids"):
            spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=4)
        with pytest.raises(ValueError, match=rf"input_ids: .* token id {bad}.* 97 ids"):
            spec_ext.accelerate(target, draft).generate(ids, attention_mask=mask, max_new_tokens=4)
    # an id under the left padding is never read: not refused
    out = spec_ext.generate(target, draft, torch.tensor([[500, 5, 6]]), attention_mask=torch.tensor([[0, 1, 1]]),
                            max_new_tokens=4, eos_token_id=[])
    assert out.sequences[0, -4:].tolist() == hf_greedy(target, [5, 6], 4, eos=[])


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_sampling_at_a_temperature_that_is_not_positive_is_refused_as_hf_refuses_it(greedy_pair, temperature):
    target, draft = greedy_pair
    ids = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="temperature"):  # HF's generate
        target.generate(ids, do_sample=True, temperature=temperature, max_new_tokens=2, pad_token_id=0)
    fast = spec_ext.accelerate(target, draft)
    with pytest.raises(ValueError, match=r"temperature: must be a positive number when do_sample=True, got "
                                         + str(temperature)):
        fast.generate(ids, do_sample=True, temperature=temperature, max_new_tokens=2)
    config = copy.deepcopy(target.generation_config)
    try:  # the same from the target's generation_config
        target.generation_config.do_sample, target.generation_config.temperature = True, temperature
        with pytest.raises(ValueError, match="temperature: must be a positive number when do_sample=True"):
            fast.generate(ids, max_new_tokens=2)
        # greedy whatever the temperature says, as HF's
        assert torch.equal(fast.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=[]),
                           target.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None))
    finally:
        target.generation_config = config


@pytest.mark.parametrize("policy", ["fixed", "tree", "pearl"])
@pytest.mark.parametrize("broken", ["target", "draft"])
def test_nan_logits_on_the_prompt_are_an_error_naming_the_model(greedy_pair, policy, broken):
    # the rounds verify unchecked; each model's logits are checked once, on the prompt
    models = dict(zip(("target", "draft"), greedy_pair))
    models[broken] = copy.deepcopy(models[broken])
    with torch.no_grad():
        models[broken].lm_head.weight[3, 0] = float("nan")
    # PEARL's draft side runs apart and reports its error through a PeerError
    with pytest.raises((ValueError, spec_ext.PeerError), match=f"{broken}: its logits on the prompt contain"):
        spec_ext.generate(models["target"], models["draft"], [[1, 2, 3], [4, 5]], max_new_tokens=4,
                          policy=policy)


def test_sampler_matches_hf_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    logits = torch.randn(6, 50)
    ours = Sampler(0.7, top_k=10, top_p=0.8).probs(logits)
    x = TemperatureLogitsWarper(0.7)(None, logits.clone())
    x = TopKLogitsWarper(10)(None, x)
    x = TopPLogitsWarper(0.8)(None, x)
    torch.testing.assert_close(ours, torch.softmax(x, -1))


def test_bonus_agreement_is_the_drafts_agreement_with_the_bonus_token():
    """The history AdaLength reads: after a round that accepted every draft, greedy asks
    whether the draft proposes the bonus token; sampling draws an acceptance with chance
    sum_x min(p, q) at that position (p: the bonus's distribution, q: the draft's)."""
    from scipy.stats import binomtest
    from spec_ext.drafters import ModelDrafter
    B, V = 4000, 5
    loop = ModelDrafter.__new__(ModelDrafter)  # only the round outcome the method reads
    loop.device, loop.generator = torch.device("cpu"), torch.Generator().manual_seed(0)
    loop.all_accepted = torch.arange(B) % 2 == 0
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    logits = torch.stack([q.log().expand(B, V), torch.zeros(B, V)], 1)  # [B,2,V]: q at the last draft
    ids = torch.stack([torch.zeros(B, dtype=torch.long), torch.arange(B) % V], 1)  # [B,2]: last draft, bonus
    last = torch.where(torch.arange(B) % 4 == 2, 0, 1)  # rows that fed their last draft while drafting
    known = loop.all_accepted & (last == 1)
    rows = torch.arange(B)
    bonus = ids[rows, last]
    before = lambda: logits[rows, (last - 1).clamp_min(0)]  # noqa: E731 (the catch-up's column before the bonus)

    loop.sampler, loop.bonus_p = Sampler(1.0), torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0]).expand(B, V)
    agreed = loop.bonus_agreement(before(), bonus, last)
    assert not agreed[~known].any()
    assert binomtest(int(agreed[known].sum()), int(known.sum()), 0.6).pvalue > 1e-3  # 0.2 + 0.2 + 0.2

    loop.sampler, loop.bonus_p = Sampler(0.0), None
    logits[:, 0, 3] = 1.0  # the draft's greedy token is 3
    agreed = loop.bonus_agreement(before(), bonus, last)
    assert agreed.tolist() == (known & (ids[:, 1] == 3)).tolist()
    loop.all_accepted[:] = False  # the first round: no bonus yet
    assert not loop.bonus_agreement(before(), bonus, last).any()


def test_sliding_window_models_decode_exactly_past_the_window():
    """A window of 16: prompt + new tokens of 12, 17 (the boundary) and 44, against HF."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, pad_token_id=0)
    target = MistralForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    draft = perturbed(target, 0.003, seed=1)
    prompt = [5, 6, 7, 9]
    for new in (8, 13, 40):
        expected = hf_greedy(target, prompt, new, eos=[])
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=new, eos_token_id=[], policy="fixed")
        assert out.sequences[0, 4:].tolist() == expected


# ------------------------------------------------------------------- a drop-in for HF generate
def test_eos_token_id_as_tensors_and_numpy_integers_stops_like_hf(greedy_pair):
    import numpy as np
    target, draft = greedy_pair
    prompts = torch.tensor([[5, 17, 33, 8], [9, 4, 4, 4]])
    free = target.generate(prompts, max_new_tokens=30, do_sample=False, pad_token_id=0)
    stops = [int(free[0, 10]), int(free[1, 7])]  # tokens each row emits early on: rows end there
    fast = spec_ext.accelerate(target, draft, policy="fixed")
    for eos in (torch.tensor(stops), stops, torch.tensor(stops[0]), np.int64(stops[0]), np.array(stops)):
        expected = target.generate(prompts, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=eos)
        got = fast.generate(prompts, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=eos)
        assert torch.equal(got, expected), eos
    with pytest.raises(ValueError, match="eos_token_id: expected a token id or a list of ids"):
        fast.generate(prompts, max_new_tokens=4, eos_token_id="2")


def test_finished_rows_are_padded_with_the_first_eos_like_hf(greedy_pair):
    target, draft = (copy.deepcopy(m) for m in greedy_pair)
    prompts = torch.tensor([[5, 17, 33, 8], [9, 4, 4, 4]])
    free = target.generate(prompts, max_new_tokens=30, do_sample=False, pad_token_id=0)
    first, other = int(free[0, 6]), int(free[0, 7])
    assert first != other
    for model in (target, draft):
        model.generation_config.pad_token_id = None
    eos = [other, first]  # HF pads with eos[0]: not the smallest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = target.generate(prompts, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    got = spec_ext.accelerate(target, draft, policy="fixed").generate(prompts, max_new_tokens=30, do_sample=False,
                                                                      eos_token_id=eos)
    assert torch.equal(got, expected)


def test_generation_config_max_length_counts_the_prompt_like_hf(greedy_pair):
    target, draft = (copy.deepcopy(m) for m in greedy_pair)
    prompts = torch.tensor([[5, 17, 33], [9, 4, 4]])
    fast = spec_ext.accelerate(target, draft, policy="fixed")
    for max_length, max_new in ((9, None), (None, None), (None, 4)):
        target.generation_config.max_length, target.generation_config.max_new_tokens = max_length, max_new
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HF's advice to set max_new_tokens: the defaults are the point here
            expected = target.generate(prompts, do_sample=False, pad_token_id=0)
        assert torch.equal(fast.generate(prompts, do_sample=False, pad_token_id=0), expected), (max_length, max_new)
    target.generation_config.max_length, target.generation_config.max_new_tokens = 3, None
    with pytest.raises(ValueError, match="generation_config.max_length=3: leaves no new token"):
        fast.generate(prompts, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name,value", [("num_beams", 4), ("forced_eos_token_id", 3), ("penalty_alpha", 0.6),
                                        ("exponential_decay_length_penalty", (4, 1.5))])
def test_generation_config_settings_that_hf_would_apply_are_refused_by_name(greedy_pair, name, value):
    target, draft = (copy.deepcopy(m) for m in greedy_pair)
    setattr(target.generation_config, name, value)
    for call in (lambda: spec_ext.accelerate(target, draft).generate(torch.tensor([[5, 6]]), max_new_tokens=4),
                 lambda: spec_ext.generate(target, draft, [[5, 6]], max_new_tokens=4)):
        with pytest.raises(ValueError, match=rf"generation_config.{name}=.*not supported by spec_ext"):
            call()
    setattr(target.generation_config, name, None)  # unset: decodes
    spec_ext.generate(target, draft, [[5, 6]], max_new_tokens=4)


def test_a_target_in_train_mode_with_dropout_is_refused():
    torch.manual_seed(0)
    target = llama(97, 64, 2, seed=0)
    target.config.attention_dropout = 0.5
    target.train()
    with pytest.raises(ValueError, match=r"target: in train mode with attention_dropout=0.5.*target.eval\(\)"):
        spec_ext.generate(target, perturbed(target, 0.003, seed=1).eval(), [[5, 6]], max_new_tokens=4)
    target.config.attention_dropout = 0.0  # train mode without dropout computes what eval mode does
    spec_ext.generate(target, perturbed(target, 0.003, seed=1), [[5, 6]], max_new_tokens=4)


HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
              torch.Tensor.nonzero, torch.nonzero}


class CountHostReads(TorchFunctionMode):
    """Counts the Python-level reads of a tensor's values on the host (on a GPU, each waits
    for the queue), wherever they are: the loop, the cache, the ops, the lean forward."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["fixed", "tree", "dynamictree"])
def test_a_round_reads_the_host_once_on_any_device(greedy_pair, policy):
    """The CPU-side guard of the GPU test below: Fixed, Tree and DynamicTree read tensor values on the
    host once per round (what was emitted), plus a few on the prompt."""
    target, draft = greedy_pair
    ids = [[5, 17, 33, 8], [9, 4]]
    reads, rounds = [], []
    for new in (8, 40):
        with CountHostReads() as counter:
            out = spec_ext.generate(target, draft, ids, max_new_tokens=new, eos_token_id=[], policy=policy)
        reads.append(counter.reads)
        rounds.append(out.stats.target_calls - 1)
    extra_rounds = rounds[1] - rounds[0]
    assert extra_rounds >= 5 and len(reads[1]) - len(reads[0]) <= extra_rounds, (rounds, reads[1])
    assert len(reads[0]) <= rounds[0] + 8, reads[0]  # the prompt's checks and the tree's set-up



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (counts the loop's host syncs)")
@pytest.mark.parametrize("policy, with_draft", [("fixed", True), ("tree", True), ("dynamictree", True), ("ngram", True),
                                               ("ngram", False)])
def test_a_round_syncs_with_the_host_about_once(greedy_pair, policy, with_draft):
    """Fixed, Tree and the text's rounds (alone and beside the draft) keep a round on the
    device: the host learns what was emitted once per round (plus the prefill's few), so the
    GPU is not idled by every length update."""
    target, draft = (copy.deepcopy(m).cuda() for m in greedy_pair)
    draft = draft if with_draft else None
    ids = [[5, 17, 33, 8], [9, 4]]
    spec_ext.generate(target, draft, ids, max_new_tokens=8, eos_token_id=[], policy=policy)  # warm-up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = spec_ext.generate(target, draft, ids, max_new_tokens=32, eos_token_id=[], policy=policy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    rounds = out.stats.target_calls - 1
    assert syncs <= rounds + 12, (syncs, rounds)


def test_a_config_that_keeps_its_vocabulary_under_text_config(greedy_pair):
    """Multimodal-style configs name vocab_size only in their text config: generate reads it there."""
    from transformers import LlamaConfig
    target, draft = (copy.deepcopy(m) for m in greedy_pair)
    prompts = [[5, 17, 33, 8], [9, 4]]
    expected = [hf_greedy(target, p, 12, eos=[]) for p in prompts]
    class NoTopLevelVocabulary(LlamaConfig):
        def __getattribute__(self, name):
            if name == "vocab_size":
                raise AttributeError(name)
            return super().__getattribute__(name)

    for model in (target, draft):
        text = LlamaConfig(**model.config.to_dict())
        model.config.text_config = text
        model.config.__class__ = NoTopLevelVocabulary
        assert not hasattr(model.config, "vocab_size") and model.config.get_text_config() is text
    out = spec_ext.generate(target, draft, prompts, max_new_tokens=12, eos_token_id=[], policy="fixed")
    assert [out.sequences[b, -12:].tolist() for b in range(2)] == expected


def test_the_unrelated_draft_warning_counts_the_draft_models_proposals_only(greedy_pair):
    """Beside good text matches a draft of another tokenizer still warns: the text's accepted
    drafts do not hide the model's rejected ones (and text drafts alone never warn)."""
    from spec_ext.engine.generate import UNRELATED_DRAFTS, warn_if_unrelated
    from spec_ext.engine import Stats
    target, draft = greedy_pair
    mixed, text_only = (Stats(row_rounds=[0], row_drafted=[0], row_accepted=[0]) for _ in range(2))
    mixed.count(0, "text", 9 * UNRELATED_DRAFTS, 9 * UNRELATED_DRAFTS)
    mixed.count(0, "model", UNRELATED_DRAFTS, 0)  # the model: 0 of 64 accepted
    with pytest.warns(UserWarning, match=f"draft: 0 of {UNRELATED_DRAFTS} drafts accepted"):
        warn_if_unrelated(target, draft, mixed)
    text_only.count(0, "text", 10 * UNRELATED_DRAFTS, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unrelated(target, draft, text_only)
    # end to end, the text's drafts are counted as such
    out = spec_ext.generate(target, None, [[5, 17, 33, 8] * 4], max_new_tokens=16, eos_token_id=[], policy="ngram")
    assert out.stats.matched > 0 and out.stats.drafted > 0
    assert (out.stats.text_drafted, out.stats.text_accepted) == (out.stats.drafted, out.stats.accepted)


def test_a_drafter_made_by_the_user_is_verified_like_any_other(greedy_pair):
    """generate takes a Drafter object: its proposals, here a fixed junk chain on one row and a
    one-hot-q tree on another, are verified exactly (greedy equals the target's)."""
    from spec_ext.drafters import Drafter, Proposal
    from spec_ext.policies import Fixed

    class Junk(Drafter):
        """Always proposes tokens 1, 2, 3: almost never accepted, never wrong."""

        def propose(self, seqs, roots, plan, forced=None, forced_rows=None):
            assert plan.budget() == [3] * len(seqs)  # the plan of the policy given to generate
            tokens = torch.tensor([[1, 2, 3]] * len(seqs))
            return Proposal(tokens, torch.full((len(seqs),), 3))

    target, _ = greedy_pair
    prompts = [[5, 17, 33, 8], [9, 4]]
    out = spec_ext.generate(target, Junk(), prompts, max_new_tokens=10, eos_token_id=[], policy=Fixed(3))
    assert [out.sequences[b, -10:].tolist() for b in range(2)] == [hf_greedy(target, p, 10, eos=[]) for p in prompts]
    assert out.stats.drafted == 3 * out.stats.rounds and out.stats.draft_calls == 0


@torch.no_grad()
def test_the_dynamic_tree_is_eagle2s_expansion_of_the_drafts_own_scores(greedy_pair):
    """The kept tree (as paths of tokens) equals EAGLE-2's expansion computed here from plain
    full-sequence forwards of the draft: per level the frontier's top-k children, the best k
    by cumulative log-probability go on; the best ``nodes`` overall are kept."""
    from spec_ext.drafters import ModelDrafter
    from spec_ext.models import attention_implementation
    from spec_ext.policies import DynamicTree, RoundPlan
    _, draft = greedy_pair
    prompts = [[5, 17, 33, 8], [9, 4, 60, 61, 2]]
    policy = DynamicTree(depth=3, top_k=3, nodes=8)
    drafter = ModelDrafter(draft)
    drafter.start(prompts, 64, Sampler())
    with attention_implementation(draft):
        proposal = drafter.propose(prompts, torch.tensor([p[-1] for p in prompts]),
                                   RoundPlan([0, 0], tree=policy.tree_shape()))
    for b, prompt in enumerate(prompts):
        def logp(path):
            return torch.log_softmax(draft(torch.tensor([prompt + list(path)])).logits[0, -1].float(), -1)
        assert tree_paths(proposal.tokens[b].tolist(), proposal.parents[b].tolist()) == eagle2_paths(logp, policy), b
    assert proposal.num_draft.tolist() == [policy.nodes - 1] * 2


def test_a_confident_draft_never_leaves_a_kept_node_without_its_parent():
    """A draft sure of its top token (log q = 0 exactly in float32) ties every child with its
    parent: the kept tree must still hold every node's parent, before it (the review's case:
    a tie-break of 1e-6 per level is lost below scores of -16)."""
    from spec_ext.drafters import grow_tree
    from spec_ext.policies import DynamicTree
    V, B = 12, 3
    generator = torch.Generator().manual_seed(0)

    def confident(n_rows):
        logits = torch.randn(n_rows, V, generator=generator) - 40  # scores far below -16
        logits[:, 0] = 60.0  # log q = 0 for token 0
        return logits

    def refeed(tokens, parents, depth, mask):
        return confident(tokens.numel()).view(*tokens.shape, V)

    policy = DynamicTree(depth=4, top_k=3, nodes=8)
    proposal = grow_tree(policy.tree_shape(), confident(B), torch.zeros(B, dtype=torch.int64), refeed)
    parents = proposal.parents.tolist()
    for row in parents:
        assert row[0] == -1 and all(0 <= p < i for i, p in enumerate(row) if i), row
