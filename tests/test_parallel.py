"""PEARL and SpecBranch in both execution modes. The greedy-equality and exact-distribution
tests of test_decoding run both in the threads mode (they are registered policies); here:
the same checks across two processes with torch.distributed (gloo), branching, and faults."""
import os
import pickle
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import spec_ext
from spec_ext import PeerError, serve_draft, shutdown
from spec_ext.engine import Sampler
from spec_ext.policies import PEARL, SpecBranch
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy, llama, perturbed

RAGGED = [[5, 17, 33, 8], [40], [9, 9, 9, 9, 9, 9, 9, 12], [70, 71]]


def greedy_models():
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    return target, perturbed(target, 0.003, seed=1)


def sampling_models():
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    return target, perturbed(target, 0.01, seed=11)


def sabotage(draft, after, action):
    """After ``after`` forwards the draft sleeps (a stall), raises, or kills its process."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] > after:
            if action == "sleep":
                time.sleep(30)
            elif action == "raise":
                raise RuntimeError("draft exploded")
            else:
                os._exit(3)

    draft.register_forward_pre_hook(hook, with_kwargs=True)
    return draft


# ------------------------------------------------------------------ threads mode
def test_threads_mode_chooses_gamma_and_reports_stats():
    target, draft = greedy_models()
    policy = PEARL()
    out = spec_ext.generate(target, draft, [RAGGED[0]], max_new_tokens=40, eos_token_id=[], policy=policy)
    assert out.sequences[0, 4:].tolist() == hf_greedy(target, RAGGED[0], 40, eos=[])
    assert 1 <= out.stats.gamma <= policy.max_draft
    assert out.stats.accepted > 0 and out.stats.draft_calls >= out.stats.drafted
    assert max(out.stats.draft_lengths) <= policy.max_draft + 1


def test_the_prompts_forward_emits_the_first_token():
    """No separate prefill: every target forward is a verification (the first reads the
    prompts and emits each row's first new token), so forwards == rounds of the batch."""
    target, draft = greedy_models()
    forwards = [0]
    target.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    out = spec_ext.generate(target, draft, RAGGED, max_new_tokens=12, eos_token_id=[], policy=PEARL(gamma=2))
    assert forwards[0] == out.stats.target_calls
    L = max(map(len, RAGGED))  # (left-padded)
    for b, prompt in enumerate(RAGGED):
        assert out.sequences[b, L:].tolist() == hf_greedy(target, prompt, 12, eos=[])
    assert out.stats.target_calls == max(out.stats.row_rounds)  # every forward verified each unfinished row


@pytest.mark.parametrize("action,match", [
    ("raise", "the draft side failed: RuntimeError: draft exploded"),
    ("sleep", r"the draft side sent nothing for 1 s(.|\n)*it was at:(.|\n)*time.sleep\(30\)")])  # names the stall
def test_threads_mode_fails_fast_when_the_draft_fails_or_stalls(action, match):
    target, draft = greedy_models()
    started = time.perf_counter()
    with pytest.raises(PeerError, match=match):
        spec_ext.generate(target, sabotage(draft, 4, action), [RAGGED[0]], max_new_tokens=40, eos_token_id=[],
                          policy=PEARL(timeout=1.0))
    assert time.perf_counter() - started < 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the draft thread's own stream)")
@pytest.mark.parametrize("method", [PEARL, SpecBranch])
def test_threads_mode_on_a_gpu_runs_the_draft_on_its_own_stream_and_stays_exact(method):
    target, draft = (model.cuda() for model in greedy_models())
    ids = torch.tensor([RAGGED[0]], device="cuda")
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=[], pad_token_id=0)
    out = spec_ext.generate(target, draft, ids, max_new_tokens=40, eos_token_id=[], policy=method())
    assert torch.equal(out.sequences, expected)
    sampled = spec_ext.generate(target, draft, ids, max_new_tokens=40, temperature=1.0, eos_token_id=[],
                                policy=method(), seed=0)
    assert sampled.sequences.shape == expected.shape and sampled.stats.accepted > 0


def test_specbranch_forks_at_uncertain_tokens_and_verifies_the_tree():
    target, draft = greedy_models()
    prompt = RAGGED[0]
    expected = hf_greedy(target, prompt, 40, eos=[])
    per_round = {}
    for branches in (1, 4):
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=40, eos_token_id=[],
                                policy=SpecBranch(branches=branches, gamma=3))
        assert out.sequences[0, 4:].tolist() == expected
        per_round[branches] = out.stats.drafted / out.stats.rounds
        if branches == 1:  # a chain: at most gamma fed drafts plus the one that arrived during the forward
            assert max(out.stats.draft_lengths) <= 4
    # siblings are sent together, so a forked root shows all its children in the next verification
    assert per_round[4] > per_round[1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="gamma: must be >= 1"):
        PEARL(gamma=0)
    with pytest.raises(ValueError, match="mode: expected 'threads' or 'distributed'"):
        PEARL(mode="mpi")
    with pytest.raises(ValueError, match="timeout: must be > 0"):
        PEARL(timeout=0)
    with pytest.raises(ValueError, match="branches: must be >= 1"):
        SpecBranch(branches=0)
    target, _ = greedy_models()
    with pytest.raises(ValueError, match="draft: required"):
        spec_ext.generate(target, None, [[1, 2]], policy=PEARL())
    with pytest.raises(ValueError, match="draft: required"):
        spec_ext.accelerate(target, None, policy="pearl")
    assert spec_ext.accelerate(target, None, policy=PEARL(mode="distributed")).config is target.config


# ------------------------------------------------------------------ distributed mode
METHODS = {"pearl": PEARL, "specbranch": SpecBranch}


def _rank_main(rank, rendezvous, results, scenario, method):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    greedy_target, greedy_draft = greedy_models()
    sample_target, sample_draft = sampling_models()
    if rank == 1:
        if scenario == "die":
            greedy_draft = sabotage(greedy_draft, 6, "exit")
        serve_draft(greedy_draft if scenario != "sample" else sample_draft, timeout=60)
        return
    report = {}
    policy = METHODS[method](mode="distributed", timeout=20.0)
    try:
        if scenario == "greedy":
            out = spec_ext.generate(greedy_target, None, [RAGGED[0]], max_new_tokens=40, eos_token_id=[],
                                    policy=policy)
            report["batch1"] = out.sequences[0, 4:].tolist()
            width = max(map(len, RAGGED))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in RAGGED])
            mask = (torch.arange(width) >= width - torch.tensor([len(p) for p in RAGGED])[:, None]).long()
            out = spec_ext.generate(greedy_target, None, ids, attention_mask=mask, max_new_tokens=30,
                                    eos_token_id=[], policy=policy)
            report["ragged"] = out.sequences[:, width:].tolist()
            report["accepted"] = out.stats.accepted
        elif scenario == "sample":
            out = spec_ext.generate(sample_target, None, [PROMPT] * 10_000, max_new_tokens=3, temperature=1.0,
                                    eos_token_id=[], policy=policy, seed=5)
            report["samples"] = out.sequences[:, len(PROMPT):].numpy()
        else:
            started = time.perf_counter()
            try:
                spec_ext.generate(greedy_target, None, [RAGGED[0]], max_new_tokens=60, eos_token_id=[],
                                  policy=METHODS[method](mode="distributed", timeout=10.0))
                report["error"] = None
            except PeerError as error:
                report["error"] = str(error)
            report["seconds"] = time.perf_counter() - started
    finally:
        if scenario != "die":
            shutdown()
        with open(results, "wb") as f:
            pickle.dump(report, f)
        if scenario == "die":
            os._exit(0)  # the group is broken; tearing it down could wait on the dead rank


def _launch(tmp_path, scenario, method) -> dict:
    results = tmp_path / "results.pkl"
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank_main, args=(rank, str(tmp_path / "rdv"), str(results), scenario, method))
                 for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=240)
    for p in processes:
        if p.is_alive():
            p.kill()
            pytest.fail(f"{scenario}: a rank hung")
    assert results.exists(), f"{scenario}: rank 0 wrote no results (exit codes {[p.exitcode for p in processes]})"
    return pickle.loads(results.read_bytes())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_distributed_greedy_equals_target(tmp_path, method):
    report = _launch(tmp_path, "greedy", method)
    target, _ = greedy_models()
    assert report["batch1"] == hf_greedy(target, RAGGED[0], 40, eos=[])
    for row, prompt in zip(report["ragged"], RAGGED):
        assert row == hf_greedy(target, prompt, 30, eos=[])
    assert report["accepted"] > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_distributed_sampling_follows_target_distribution(tmp_path, method):
    report = _launch(tmp_path, "sample", method)
    target, _ = sampling_models()
    assert_follows(np.asarray(report["samples"]), exact_joint(target, Sampler(1.0)))


def test_distributed_target_raises_when_the_draft_rank_dies(tmp_path):
    report = _launch(tmp_path, "die", "specbranch")
    assert report["error"] is not None and "draft side" in report["error"], report
    assert report["seconds"] < 15, report
