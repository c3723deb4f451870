"""MTP drafting on a small MTP-bearing target made here: the bundled target (a Llama, 8 layers,
320 wide) with one MTP layer added (transformers' ``MtpLayer`` over a Llama decoder layer, its
block started from the target's last layer) and trained briefly on the target's own greedy
continuations of stdlib code (``on_policy_splits``: the target's last hidden states cached).

The layer is written in the layout transformers' ``MtpModel.from_pretrained`` reads (the MTP
block as decoder layer L beside ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``; the
config's ``num_mtp_layers``), so the same weights draft in spec_ext (``"mtp"``) and in
``generate(use_mtp=True)``; and as a speculators ``mtp`` directory. Then, on held-out prompts,
greedy, interleaved and repeated: accepted per round, tokens/s and the speed-up against the
target alone (``target.generate``) and against ``generate(use_mtp=True)`` (batch 1 only: it
refuses more), at B=1 and B=8, on the same eight prompts (B=1: each alone, one after another;
B=8: together). Writes benchmarks/results/mtp_cpu.{csv,txt}. The trained layer is kept in
--work (reused by a later run with the same --steps and --sequences).

    python benchmarks/mtp.py [--steps 300] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from stdlib_data import split_files  # noqa: E402

import spec_ext  # noqa: E402
from spec_ext.models.mtp import save_speculators_mtp  # noqa: E402
from spec_ext.policies import Fixed  # noqa: E402
from spec_ext.training.corpus import on_policy_splits  # noqa: E402


def with_mtp_config(target):
    text = target.config.get_text_config()
    text.num_mtp_layers = 1
    if getattr(text, "layer_types", None) is not None:
        text.mtp_layer_types = [text.layer_types[-1]]
    return target


def train_mtp(target, data, steps: int, batch: int, lr: float, seed: int):
    """One MTP layer for ``target`` trained on (tokens, last hidden states): step 0 (layer at
    index p predicts x_{p+2}) and step 1 (the layer re-applied to its own output, x_{p+3}),
    teacher-forced."""
    from transformers import initialization
    from transformers.modeling_layers import MtpModel
    torch.manual_seed(seed)
    with initialization.no_tie_weights():
        mtp = MtpModel(target, 1)
    layer = mtp.layers[0]
    layer.mtp_block.load_state_dict(target.get_decoder().layers[-1].state_dict())
    with torch.no_grad():
        H = target.config.hidden_size
        layer.eh_proj.weight.copy_(torch.cat([0.02 * torch.randn(H, H), torch.eye(H)], 1))
        for norm in (layer.enorm, layer.hnorm, layer.post_norm):
            norm.weight.fill_(1.0)
    mtp.train()
    params = [p for n, p in mtp.named_parameters() if n.startswith("layers.")]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    tokens, last = data
    N, T = tokens.shape
    n = T - 3
    positions = torch.arange(T)[None]
    g = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for step in range(steps):
        rows = torch.randint(0, N, (batch,), generator=g)
        ids, h = tokens[rows], last[rows].float()
        hidden, loss = h[:, :n], 0.0
        for k, weight in enumerate((1.0, 0.5)):
            hidden = mtp.forward_layer(0, hidden, positions[:, k + 1:k + 1 + n].expand(batch, -1), None,
                                       input_ids=ids[:, k + 1:k + 1 + n])
            logits = mtp._project_to_logits(hidden)
            loss = loss + weight * F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   ids[:, k + 2:k + 2 + n].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    return mtp.eval()


def write_checkpoint(target, mtp, path: Path):
    """``target`` and its MTP layer as transformers lays out a checkpoint with MTP weights."""
    target.save_pretrained(path)
    L = target.config.num_hidden_layers
    state = load_file(str(path / "model.safetensors"))
    layer = mtp.layers[0]
    for name, tensor in layer.mtp_block.state_dict().items():
        state[f"model.layers.{L}.{name}"] = tensor.detach().clone().contiguous()
    for part, key in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("post_norm", "shared_head.norm")):
        state[f"model.layers.{L}.{key}.weight"] = getattr(layer, part).weight.detach().clone().contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_with_mtp(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}\..*"]
    return model


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "mtp")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mtp_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = with_mtp_config(AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval())
    args.work.mkdir(parents=True, exist_ok=True)
    L = target.config.num_hidden_layers
    with torch.no_grad():
        data = on_policy_splits(target, tokenizer, split_files("train"), split_files("validation"), (L,), args.work,
                                args.sequences, 16, 64, 64, seed=0)
    tokens, _, last = data["train"]
    kept = args.work / f"mtp_layer_steps{args.steps}_seqs{args.sequences}.pt"
    if kept.exists():  # the same training (seeded) done before
        mtp = train_mtp(target, (tokens, last), 0, 8, 1e-3, 0)
        mtp.layers.load_state_dict(torch.load(kept))
    else:
        mtp = train_mtp(target, (tokens, last), args.steps, 8, 1e-3, 0)
        torch.save(mtp.layers.state_dict(), kept)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "target-mtp"
        write_checkpoint(target, mtp, path)
        model = load_with_mtp(path)
        save_speculators_mtp(spec_ext.models.mtp.load_mtp(model), Path(root) / "speculators-mtp", model)
        val_tokens = data["validation"][0]
        prompts = [row[:64].tolist() for row in val_tokens[:8]]
        eos = tokenizer.eos_token_id
        for B in (1, 8):
            groups = [[p] for p in prompts] if B == 1 else [prompts]  # B=1: the same prompts, one at a time
            new = args.new_tokens

            def each(fn):
                return lambda: [fn(group) for group in groups]

            runs = {"target": each(lambda g: model.generate(torch.tensor(g), max_new_tokens=new, do_sample=False,
                                                            eos_token_id=None, pad_token_id=eos))}
            if B == 1:
                runs["hf use_mtp"] = each(lambda g: model.generate(torch.tensor(g), max_new_tokens=new, do_sample=False,
                                                                   use_mtp=True, eos_token_id=None, pad_token_id=eos))
            for k in (1, 2, 3):
                runs[f"spec_ext Fixed({k})"] = each(lambda g, k=k: spec_ext.generate(
                    model, "mtp", g, max_new_tokens=new, eos_token_id=[], policy=Fixed(k)))
            runs["spec_ext Auto"] = each(lambda g: spec_ext.generate(model, "mtp", g, max_new_tokens=new,
                                                                     eos_token_id=[]))
            times = {name: [] for name in runs}
            outputs, calls = {}, [0]
            with torch.no_grad():
                for name, fn in runs.items():  # warm-up
                    if name == "hf use_mtp":
                        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
                    outputs[name] = fn()
                    if name == "hf use_mtp":
                        hook.remove()
                for _ in range(args.repeats):  # interleaved
                    for name, fn in runs.items():
                        times[name].append(timed(fn)[1])
            reference = outputs["target"]
            for name in runs:
                outs = outputs[name]
                equal = all(torch.equal((o.sequences if hasattr(o, "sequences") else o)[:, :r.shape[1]], r)
                            for o, r in zip(outs, reference))
                per_round = ""
                if hasattr(outs[0], "stats"):  # accepted drafts per (row, verification), over all prompts
                    per_round = f"{sum(o.stats.accepted for o in outs) / max(1, sum(o.stats.rounds for o in outs)):.2f}"
                    if B == 1:  # the first prompt's alone (the number this benchmark reported before)
                        per_round += f" (prompt 0: {outs[0].stats.mean_accepted:.2f})"
                    else:  # verifications: the batch runs until its slowest row is done
                        per_round += f" ({outs[0].stats.target_calls - 1} verifications)"
                if name == "hf use_mtp":  # accepted = new tokens - target forwards (prefill's token, one per round)
                    forwards = calls[0] - len(groups)
                    per_round = f"{(new * len(groups) - calls[0]) / max(1, forwards):.2f}"
                median = statistics.median(times[name])
                rows.append(dict(B=B, method=name, median_s=median, tokens_per_s=len(prompts) * new / median,
                                 speedup_vs_target=statistics.median(times["target"]) / median,
                                 speedup_vs_use_mtp=(statistics.median(times["hf use_mtp"]) / median) if B == 1 else
                                 float("nan"), accepted_per_round=per_round, equal_to_target=equal))
                print(rows[-1], flush=True)
    commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
    header = ["B", "method", "median_s", "tokens_per_s", "speedup_vs_target", "speedup_vs_use_mtp",
              "accepted_per_round", "equal_to_target"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w") as f:
        f.write(",".join(header + ["commit"]) + "\n")
        for r in rows:
            f.write(",".join(str(r[h]) for h in header) + f",{commit}\n")
    with open(args.out.with_suffix(".txt"), "w") as f:
        f.write(f"# benchmarks/mtp.py, commit {commit}: LOADED machine (2 cores shared with other jobs), "
                f"{args.threads} thread(s), greedy, {args.new_tokens} new tokens, {args.repeats} interleaved repeats "
                f"after warm-up; the same {len(prompts)} prompts at B=1 (one at a time) and B=8; load (uptime) "
                f"{os.getloadavg()[0]:.1f}; MTP layer trained {args.steps} steps on {args.sequences} on-policy sequences\n")
        for r in rows:
            f.write(f"B={r['B']} {r['method']:<20} {r['median_s']:.3f}s {r['tokens_per_s']:.0f} tok/s "
                    f"x{r['speedup_vs_target']:.2f} vs target, x{r['speedup_vs_use_mtp']:.2f} vs use_mtp, "
                    f"accepted/round {r['accepted_per_round'] or '-'}, equal {r['equal_to_target']}\n")


if __name__ == "__main__":
    main()
