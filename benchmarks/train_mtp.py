"""Train the MTP layer of benchmarks/mtp.py's MTP-bearing target: the bundled target (a Llama,
8 layers, 320 wide) with one transformers ``MtpLayer`` over a Llama decoder layer (its block
started from the target's last layer), trained on the target's own greedy continuations of
prompts from the standard library's training split, distilled from the target's distributions.

Data: the target's greedy continuations (``spec_ext.training.corpus``: prompts of
--prompt-tokens cut from the training split, --new-tokens continued) and its last hidden state
(HF's ``hidden_states[L]``, bf16). The same cache names as ``on_policy_splits`` (a fingerprint
of the target's config, the files and the sizes): found under --work, or under --reuse (the
DFlash training's work directory holds the same continuations with 2048 x (128 + 96) tokens:
only the ``last`` tensor is read from its features file), else generated into --work.

Loss (teacher-forced, every position p): step 0, the layer at p over ``hnorm(h_p)`` and
``enorm(embed(x_{p+1}))``, against the target's distribution of x_{p+2} (``lm_head(h_{p+1})``,
forward KL); step 1 (weight --step1-weight), the layer re-applied at p+1 to its own output and
x_{p+2}, against the target's distribution of x_{p+3} (what chains longer than the layers draft).

Held-out (the validation split's continuations, positions inside the continuation, where the
context is the target's own text as in decoding): second-token agreement (the layer's argmax at p
= the target's greedy x_{p+2}), step 1's agreement, and the expected acceptance at T=1
(sum min(p, q)). Checkpoints (``mtp_checkpoint.pt`` in --work) every --checkpoint-every steps: a
rerun with the same settings resumes; --stop-at HH:MM (UTC) saves and stops there. The learning
curve is appended to ``mtp_curve.csv`` in --work; the layer to --out (``MtpModel.layers`` state).

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/train_mtp.py --steps 2400 --stop-at 17:40
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from stdlib_data import split_files  # noqa: E402

from spec_ext.training.corpus import (continuations, cosine_lr, fingerprint, load_checkpoint,  # noqa: E402
                                      prompts_from_files, save_checkpoint, tap_features)


@dataclass(frozen=True)
class MtpTraining:
    sequences: int = 2048
    validation_sequences: int = 32
    prompt_tokens: int = 128
    new_tokens: int = 96
    steps: int = 2400
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 50
    step1_weight: float = 0.5
    seed: int = 0


def with_mtp_config(target):
    """``target`` with ``num_mtp_layers = 1`` in its config (the layer's attention type its last layer's)."""
    text = target.config.get_text_config()
    text.num_mtp_layers = 1
    if getattr(text, "layer_types", None) is not None:
        text.mtp_layer_types = [text.layer_types[-1]]
    return target


def new_mtp(target, seed: int):
    """transformers' ``MtpModel`` of one layer for ``target``: the block a copy of the target's last
    decoder layer, ``eh_proj`` passing the hidden state through (plus small noise on the embedding
    half), the norms at 1."""
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
    return mtp


def split_data(target, tokenizer, files, count: int, seed: int, s: MtpTraining, work: Path, reuse: Path | None):
    """(tokens [N,P+C] int64, last hidden states [N,P+C,H] bf16) of one split, cached as
    ``on_policy_splits`` names them."""
    from safetensors import safe_open
    key = fingerprint(target, files, seed, count, s.prompt_tokens, s.new_tokens)
    split = "train" if files == split_files("train") else "validation"
    for where in [w for w in (work, reuse) if w is not None]:
        tokens = where / f"{split}_{key}.pt"
        features = sorted(where.glob(f"{split}_{key}_features_*.safetensors"))
        if tokens.exists() and features:
            with safe_open(str(features[0]), "pt") as f:
                return torch.load(tokens), f.get_tensor("last")
    prompts = prompts_from_files(tokenizer, files, count, s.prompt_tokens, seed)
    tokens = continuations(target, prompts, s.new_tokens, True, 64, work / f"{split}_{key}.pt")
    _, last = tap_features(target, tokens, (target.config.num_hidden_layers,),
                           work / f"{split}_{key}_features_{target.config.num_hidden_layers}.safetensors")
    return tokens, last


def losses(mtp, ids, h, step1_weight: float):
    """Teacher-forced loss over ``ids`` [B,T] with the target's last hidden states ``h`` [B,T,H]
    (float32): step 0 and, weighted, step 1 (forward KL against ``lm_head(h)``)."""
    B, T = ids.shape
    n = T - 3
    positions = torch.arange(T)[None]
    with torch.no_grad():
        target_logp = F.log_softmax(mtp._project_to_logits(h).float(), -1)
    hidden, loss = h[:, :n], 0.0
    for k, weight in ((0, 1.0), (1, step1_weight)):
        if weight == 0:
            break
        hidden = mtp.forward_layer(0, hidden, positions[:, k + 1:k + 1 + n].expand(B, -1), None,
                                   input_ids=ids[:, k + 1:k + 1 + n])
        logp = F.log_softmax(mtp._project_to_logits(hidden), -1)
        p = target_logp[:, k + 1:k + 1 + n]
        loss = loss + weight * (p.exp() * (p - logp)).sum(-1).mean()
    return loss


@torch.no_grad()
def evaluate(mtp, tokens, last, start: int, batch: int = 8) -> dict:
    """Held-out agreement of step 0 and step 1 with the target's greedy tokens and step 0's
    expected acceptance at T=1, over positions p >= ``start`` - 1 (x_{p+1} the target's own)."""
    mtp.eval()
    agree0 = agree1 = accept = count0 = count1 = 0.0
    for i in range(0, len(tokens), batch):
        ids, h = tokens[i:i + batch], last[i:i + batch].float()
        B, T = ids.shape
        n = T - 3
        positions = torch.arange(T)[None].expand(B, -1)
        target_logits = mtp._project_to_logits(h)
        hidden = mtp.forward_layer(0, h[:, :n], positions[:, 1:1 + n], None, input_ids=ids[:, 1:1 + n])
        l0 = mtp._project_to_logits(hidden)
        hidden1 = mtp.forward_layer(0, hidden, positions[:, 2:2 + n], None, input_ids=ids[:, 2:2 + n])
        l1 = mtp._project_to_logits(hidden1)
        keep = slice(start - 1, n)  # p from start-1: x_{p+1} and x_{p+2} continuation tokens
        t0, t1 = target_logits[:, 1:1 + n][:, keep], target_logits[:, 2:2 + n][:, keep]
        agree0 += (l0[:, keep].argmax(-1) == t0.argmax(-1)).sum().item()
        agree1 += (l1[:, keep].argmax(-1) == t1.argmax(-1)).sum().item()
        accept += torch.minimum(l0[:, keep].softmax(-1), t0.softmax(-1)).sum(-1).sum().item()
        count0 += t0.shape[0] * t0.shape[1]
        count1 += t1.shape[0] * t1.shape[1]
    mtp.train()
    return dict(agree_step0=agree0 / count0, agree_step1=agree1 / count1, accept_t1=accept / count0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "mtp")
    parser.add_argument("--reuse", type=Path, default=ROOT / "benchmarks" / ".train_work" / "dflash")
    parser.add_argument("--out", type=Path, default=None, help="default: WORK/mtp_layer.pt")
    for field, value in asdict(MtpTraining()).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--validate-every", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--stop-at", default=None, help="HH:MM UTC: checkpoint and stop there")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = MtpTraining(**{f: getattr(args, f) for f in asdict(MtpTraining())})
    out = args.out or args.work / "mtp_layer.pt"
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.config._name_or_path = args.target.name  # the fingerprint the DFlash training's cache has
    with torch.no_grad():
        tokens, last = split_data(target, tokenizer, split_files("train"), settings.sequences, settings.seed,
                                  settings, args.work, args.reuse)
        val_tokens, val_last = split_data(target, tokenizer, split_files("validation"), settings.validation_sequences,
                                          settings.seed + 1, settings, args.work, args.reuse)
    print(f"train {tuple(tokens.shape)}, held out {tuple(val_tokens.shape)}", flush=True)
    for p in target.parameters():
        p.requires_grad_(False)
    mtp = new_mtp(with_mtp_config(target), settings.seed)
    mtp.train()
    params = [p for n, p in mtp.named_parameters() if n.startswith("layers.")]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(settings.seed)
    path, curve = args.work / "mtp_checkpoint.pt", args.work / "mtp_curve.csv"
    state, step = load_checkpoint(path, asdict(settings)), 0
    if state is not None:
        mtp.layers.load_state_dict(state["layers"])
        optimizer.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    else:
        curve.write_text("step,seconds,train_loss,agree_step0,agree_step1,accept_t1\n")
        scores = evaluate(mtp, val_tokens, val_last, settings.prompt_tokens)
        with open(curve, "a") as f:
            f.write(f"0,0,,{scores['agree_step0']:.4f},{scores['agree_step1']:.4f},{scores['accept_t1']:.4f}\n")
        print(f"step 0 held out {scores}", flush=True)
    stop = None
    if args.stop_at:
        hh, mm = map(int, args.stop_at.split(":"))
        now = datetime.datetime.now(datetime.timezone.utc)
        stop = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
    started, seconds, running = time.perf_counter(), state["seconds"] if state else 0.0, []
    N = len(tokens)

    def checkpoint():
        save_checkpoint(path, asdict(settings), layers=mtp.layers.state_dict(), optimizer=optimizer.state_dict(),
                        generator=g.get_state(), step=step, seconds=seconds + time.perf_counter() - started)

    while step < settings.steps:
        rows = torch.randint(0, N, (settings.batch,), generator=g)
        loss = losses(mtp, tokens[rows], last[rows].float(), settings.step1_weight)
        optimizer.zero_grad()
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, settings.lr, settings.warmup, settings.steps)
        optimizer.step()
        running.append(loss.item())
        step += 1
        if step % args.checkpoint_every == 0 or step == settings.steps:
            checkpoint()
        if step % args.validate_every == 0 or step == settings.steps:
            scores = evaluate(mtp, val_tokens, val_last, settings.prompt_tokens)
            elapsed = seconds + time.perf_counter() - started
            with open(curve, "a") as f:
                f.write(f"{step},{elapsed:.0f},{sum(running) / len(running):.4f},{scores['agree_step0']:.4f},"
                        f"{scores['agree_step1']:.4f},{scores['accept_t1']:.4f}\n")
            print(f"step {step} ({elapsed:.0f} s) loss {sum(running) / len(running):.3f} held out {scores}",
                  flush=True)
            running = []
            torch.save(mtp.layers.state_dict(), out)
        elif step % 25 == 0:
            print(f"step {step} ({seconds + time.perf_counter() - started:.0f} s) loss {loss.item():.3f}", flush=True)
        if stop is not None and time.time() >= stop:
            checkpoint()
            torch.save(mtp.layers.state_dict(), out)
            print(f"stopped at step {step} (--stop-at {args.stop_at})", flush=True)
            return
    torch.save(mtp.layers.state_dict(), out)
    print(f"done: {out}", flush=True)


if __name__ == "__main__":
    main()
