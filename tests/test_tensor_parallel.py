"""A target split across 2 processes by transformers' tensor parallelism (gloo, CPU), spawned
by the tests themselves: greedy output equals the whole target's generate, sampling follows
its exact distribution, and a rank that dies makes the other raise PeerError in time."""
import multiprocessing
import os
import socket
import time
import traceback
import warnings

import pytest
import torch

import spec_ext
from spec_ext.engine import PeerError
from spec_ext.models import SpecCache, mirrored
from spec_ext.policies import PEARL, POLICIES
from helpers import PROMPT, VOCAB, assert_follows, exact_joint, hf_greedy, llama, make_policy, perturbed

pytest.importorskip("accelerate", reason="transformers' tensor parallelism needs accelerate (pip install accelerate)")

WORLD = 2
PROMPTS = [[5, 17, 33, 8], [40], [9, 9, 9, 9, 9, 12]]
NEW = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, port, worker, folder, env):
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        result = worker(rank, folder)
    except BaseException as error:  # noqa: BLE001 - the test reads what happened
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_ranks(worker, folder, timeout=240, **env):
    """Run ``worker(rank, folder)`` on WORLD spawned ranks; their results (or errors) by rank
    (None where a rank wrote nothing) and exit codes."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=_rank_main, args=(r, port, worker, str(folder), env)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + timeout
    for p in ranks:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(ranks) if p.is_alive()]
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {timeout} s"
    results = [torch.load(folder / f"rank{r}.pt", weights_only=False) if (folder / f"rank{r}.pt").exists() else None
               for r in range(WORLD)]
    return results, [p.exitcode for p in ranks]


def _load(folder):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    target = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "target"), dtype=torch.float32,
                                                  distributed_config=DistributedConfig(tp_size=WORLD)).eval()
    draft = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "draft"), dtype=torch.float32).eval()
    return target, draft


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_pair")
    target = llama(97, 64, 2, seed=0, sharpen=4.0)
    target.save_pretrained(folder / "target")
    perturbed(target, 0.003, seed=1).save_pretrained(folder / "draft")
    return folder, target


GREEDY_POLICIES = sorted(POLICIES)  # the parallel ones in threads mode: their draft thread runs on the leader


def _greedy_worker(rank, folder):
    target, draft = _load(folder)
    eos = int(open(os.path.join(folder, "eos")).read())
    out = {}
    for name in GREEDY_POLICIES:
        result = spec_ext.generate(target, draft, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0,
                                   policy=make_policy(name, target, draft))
        out[name] = result.sequences
    try:
        spec_ext.generate(target, draft, PROMPTS, max_new_tokens=4, policy=PEARL(mode="distributed"))
    except ValueError as error:
        out["pearl distributed"] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = spec_ext.generate(target, draft, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0,
                                   policy="fixed", fast_linear=True)
    out["fast_linear"] = result.sequences
    out["fast_linear warnings"] = [str(w.message) for w in caught]
    return out


def test_greedy_with_a_split_target_equals_the_whole_targets_generate(saved_pair, tmp_path):
    folder, target = saved_pair
    free_run = hf_greedy(target, PROMPTS[0], NEW, eos=[])
    eos = next(t for i, t in enumerate(free_run) if i >= 6 and t not in free_run[:i])  # row 0 stops mid-way
    (folder / "eos").write_text(str(eos))
    results, codes = run_ranks(_greedy_worker, folder)
    assert codes == [0] * WORLD, results
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("traceback")
        for name in GREEDY_POLICIES:
            rows = result[name][:, -NEW:].tolist()
            for b, prompt in enumerate(PROMPTS):
                expected = hf_greedy(target, prompt, NEW, eos=[eos])
                assert rows[b][:len(expected)] == expected, f"rank {rank}, {name}, row {b}"
                assert all(t == 0 for t in rows[b][len(expected):]), f"rank {rank}, {name}, row {b}"
        assert "no rank is left for the draft" in result["pearl distributed"]
        assert torch.equal(result["fast_linear"], result["fixed"])  # the split target keeps HF's modules
        if rank == 0:  # the leader prepares the target's forward: it says why the lean forward steps aside
            assert any("split across 2 ranks by tensor parallelism" in w for w in result["fast_linear warnings"])
    assert len(hf_greedy(target, PROMPTS[0], NEW, eos=[eos])) < NEW  # EOS was reached


def _sampling_worker(rank, folder):
    target, draft = _load(folder)
    out = {}
    for name in ("fixed", "tree"):
        result = spec_ext.generate(target, draft, [PROMPT] * 20_000, max_new_tokens=3, temperature=1.0,
                                   eos_token_id=[], policy=name, seed=7 + rank)  # a follower's seed is never used
        out[name] = result.sequences[:, len(PROMPT):]
        out[name + " accepted"] = result.stats.accepted
    return out


def test_sampling_with_a_split_target_follows_the_targets_distribution(tmp_path):
    target = llama(VOCAB, 32, 2, seed=10, sharpen=3.0)
    target.save_pretrained(tmp_path / "target")
    perturbed(target, 0.01, seed=11).save_pretrained(tmp_path / "draft")
    results, codes = run_ranks(_sampling_worker, tmp_path)
    assert codes == [0] * WORLD and "error" not in results[0], results[0].get("traceback")
    joint = exact_joint(target, spec_ext.engine.Sampler(1.0))
    for name in ("fixed", "tree"):
        assert torch.equal(results[0][name], results[1][name]), f"{name}: the ranks returned different samples"
        assert_follows(results[0][name].numpy(), joint)
        assert results[0][name + " accepted"] > 0


def _dying_worker(rank, folder):
    """The rank named in the file ``dies`` exits abruptly at its third target forward."""
    target, draft = _load(folder)
    if rank == int(open(os.path.join(folder, "dies")).read()):
        calls = []

        def die(module, args, kwargs):
            calls.append(1)
            if len(calls) == 3:
                os._exit(3)
        target.register_forward_pre_hook(die, with_kwargs=True)
    started = time.monotonic()
    try:
        spec_ext.generate(target, draft, PROMPTS, max_new_tokens=NEW, eos_token_id=[], policy="fixed")
    except PeerError as error:
        return {"peer_error": str(error), "seconds": time.monotonic() - started}
    return {"finished": True}


@pytest.mark.parametrize("dies", [0, 1], ids=["leader dies", "follower dies"])
def test_a_rank_that_dies_makes_the_other_raise_within_the_timeout(saved_pair, dies):
    folder, _ = saved_pair
    (folder / "dies").write_text(str(dies))
    results, codes = run_ranks(_dying_worker, folder, timeout=120, SPEC_EXT_TP_TIMEOUT="20")
    assert codes[dies] == 3
    survivor = results[1 - dies]
    assert survivor is not None and "peer_error" in survivor, survivor
    assert "tensor parallelism" in survivor["peer_error"] and "no output is returned" in survivor["peer_error"]
    assert survivor["seconds"] < 20 + 10


def _absent_worker(rank, folder):
    """Both ranks load the split target (that is collective); rank 1 then never calls
    generate: it waits until rank 0 has given up (its result file exists)."""
    target, draft = _load(folder)
    if rank == 1:
        deadline = time.monotonic() + 100
        while not os.path.exists(os.path.join(folder, "rank0.pt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {"waited": True}
    try:
        spec_ext.generate(target, draft, PROMPTS, max_new_tokens=4, eos_token_id=[], policy="fixed")
    except PeerError as error:
        return {"peer_error": str(error)}
    return {"finished": True}


def test_a_follower_that_never_reaches_generate_is_named_by_the_leader(saved_pair, tmp_path):
    """Like a follower that dies: a PeerError naming rank 1 and the timeout it waited, not
    the process group's store error."""
    folder, _ = saved_pair
    for name in ("target", "draft"):
        (tmp_path / name).symlink_to(folder / name)
    results, codes = run_ranks(_absent_worker, tmp_path, timeout=120, SPEC_EXT_TP_TIMEOUT="5")
    assert codes == [0] * WORLD, results
    leader = results[0]
    assert "peer_error" in leader, leader
    assert leader["peer_error"].startswith("tensor parallelism: rank 1 did not reach generate within 5 s "
                                           "(SPEC_EXT_TP_TIMEOUT") and "no output is returned" in leader["peer_error"]
    assert results[1] == {"waited": True}


def test_a_mirrored_cache_tells_the_other_ranks_everything_they_need(saved_pair):
    """The messages of a leader's cache, replayed on another cache, leave it the same rows,
    lengths and contents, and announce each forward with its inputs (one process)."""
    _, target = saved_pair
    messages = []
    with mirrored(target, messages.append):
        leader = SpecCache.for_model(target, batch_size=3, capacity=16)
    assert messages[0][0] == "cache"
    follower = SpecCache(*messages[0][1:])
    torch.manual_seed(0)
    for layer in range(len(leader)):
        keys, values = torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)
        for cache in (leader, follower):
            cache.update(keys, values, layer)
    leader.advance([6, 6, 6], torch.full((3,), 6))
    leader.rollback([4, 5, 2], torch.tensor([4, 5, 2]))
    leader.commit(torch.tensor([[0, 2, -1], [0, 1, 2], [0, -1, -1]]), torch.tensor([1, 2, 0]))
    leader.keep_rows([0, 2])
    leader.reserve(40)
    ids, positions = torch.tensor([[1], [2]]), torch.tensor([[6], [3]])
    leader.before_forward(ids, positions, None)
    kind, changes, sent_ids, sent_positions, sent_mask = messages[1]
    assert kind == "step" and [name for name, _ in changes] == ["advance", "rollback", "commit", "keep_rows", "reserve"]
    assert torch.equal(sent_ids, ids) and torch.equal(sent_positions, positions) and sent_mask is None
    for name, args in changes:
        getattr(follower, name)(*args)
    assert follower.host_lengths == leader.host_lengths == [6, 3]
    assert torch.equal(follower.lengths, leader.lengths) and torch.equal(follower.buffer, leader.buffer)
    assert follower.capacity == leader.capacity == 40
