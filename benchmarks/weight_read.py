"""A target whose decode step is weight reads, with the bundled target's function.

The bundled target (models/stdlib-target: 8 layers, hidden 320, MLP 864) reads ~33 MB per
step in float32, which stays in this machine's caches, so a verification of k+1 tokens
costs arithmetic there, not reads. :func:`widened_target` widens every MLP with zero rows:
gate and up projections get ``intermediate_size - 864`` zero output rows and the down
projection as many zero input columns. The new channels compute silu(0) * 0 = 0 and the
down projection adds 0 * them, so every logit is the original's in exact arithmetic (a
float32 GEMM over the longer inner dimension may block its sums differently, so the last
bits can differ; greedy outputs are compared in e2e.py). At 16384: 8 x 3 x 320 x 16384 = 126M MLP parameters, ~0.5 GB of float32 read per step.

Built on the fly from the loaded model (a few seconds); nothing large is committed.

    from weight_read import widened_target
    big = widened_target(target)            # target: a loaded LlamaForCausalLM (or any gate/up/down MLP)
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def _widen_linear(linear: nn.Linear, out_features: int | None = None, in_features: int | None = None) -> nn.Linear:
    """A copy of ``linear`` with zero output rows appended up to ``out_features`` (and a zero
    bias there) or zero input columns appended up to ``in_features``."""
    out_now, in_now = linear.weight.shape
    out_features, in_features = out_features or out_now, in_features or in_now
    if out_features < out_now or in_features < in_now:
        raise ValueError(f"intermediate_size: cannot narrow a {in_now} -> {out_now} projection to "
                         f"{in_features} -> {out_features}")
    wide = nn.Linear(in_features, out_features, bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype)
    weight = torch.zeros(out_features, in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    weight[:out_now, :in_now] = linear.weight.detach()
    wide.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        bias = torch.zeros(out_features, dtype=linear.bias.dtype, device=linear.bias.device)
        bias[:out_now] = linear.bias.detach()
        wide.bias = nn.Parameter(bias, requires_grad=False)
    return wide


def widened_target(target: nn.Module, intermediate_size: int = 16384) -> nn.Module:
    """A copy of ``target`` (a causal LM whose decoder MLPs have ``gate_proj``, ``up_proj``
    and ``down_proj`` linears: Llama, Qwen2/3, Mistral, Gemma...) with every MLP widened by
    zero rows to ``intermediate_size`` channels; the same function, more weights to read.
    ``config.intermediate_size`` is updated to match. ``target`` itself is left unchanged.

    Raises ValueError where the model has no such MLP or ``intermediate_size`` is smaller
    than the model's own."""
    mlps = [m for m in target.modules() if all(isinstance(getattr(m, name, None), nn.Linear)
                                               for name in ("gate_proj", "up_proj", "down_proj"))]
    if not mlps:
        raise ValueError(f"target: {type(target).__name__} has no gate_proj/up_proj/down_proj MLP to widen")
    own = mlps[0].gate_proj.out_features
    if intermediate_size < own:
        raise ValueError(f"intermediate_size: must be >= the target's own {own}, got {intermediate_size}")
    # copy everything but the MLP weights (those are rebuilt), so the copy never holds two sets
    skip = {id(p) for m in mlps for name in ("gate_proj", "up_proj", "down_proj") for p in getattr(m, name).parameters()}
    memo = {i: None for i in skip}
    wide = copy.deepcopy(target, memo)
    for original, mlp in zip(mlps, [m for m in wide.modules() if all(
            hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj")) and isinstance(m.down_proj, nn.Linear)]):
        mlp.gate_proj = _widen_linear(original.gate_proj, out_features=intermediate_size)
        mlp.up_proj = _widen_linear(original.up_proj, out_features=intermediate_size)
        mlp.down_proj = _widen_linear(original.down_proj, in_features=intermediate_size)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = intermediate_size
    config = getattr(wide, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.intermediate_size = intermediate_size
    wide.eval()
    return wide


def read_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a decode step reads (every parameter once; a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def main() -> None:
    """Issue 49's goals where the step is weight reads, on the lean forward WITH the fast
    linear (``fast_linear="auto"``, the default): the cost of a verification of w tokens over
    one decode step (B=1, fastest of --repeats, widths interleaved), and B=1 greedy speed-ups
    of the bundled head (Fixed(4)), the draft model (Fixed(k)) and Auto against the target alone
    on the same forward (methods interleaved per prompt and pass; medians of per-prompt ratios,
    min-max spread). Writes <name>.csv and <name>_verify.csv under benchmarks/results.

        python benchmarks/weight_read.py [--widen 16384] [--prompts 4] [--new-tokens 64] [--repeats 2]
    """
    import argparse
    import csv
    import os
    import statistics
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import spec_ext
    from e2e import lean_alone
    from spec_ext.bundled import bundled_path
    from spec_ext.drafters import load
    from stdlib_data import code_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--widen", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (methods interleaved)")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16])
    parser.add_argument("--draft-k", type=int, nargs="+", default=[4, 5])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--name", default="e2e_weight_read_cpu_fast")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = Path(__file__).resolve().parent / "results"
    small = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-target"), dtype=torch.float32).eval()
    target = widened_target(small, args.widen) if args.widen else small
    draft = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-draft"), dtype=torch.float32).eval()
    head = load(bundled_path("stdlib-head"), target)
    tokenizer = AutoTokenizer.from_pretrained(bundled_path("stdlib-target"))
    prompts = code_prompts(tokenizer, split="test", count=args.prompts)
    load_before = os.getloadavg()[0]
    print(f"load {load_before:.2f}; {args.threads} thread(s); skinny_linear {spec_ext.ops.linear.cpu_isa()}; "
          f"target reads {read_bytes(target) / 1e6:.0f} MB per step")

    # verification cost by width over one step, per forward (fast linear, and HF's arithmetic)
    prompt = torch.tensor([prompts[0]])
    L = prompt.shape[1]
    times = {(fast, w): [] for fast in ("auto", False) for w in args.widths}
    with torch.inference_mode():
        for _ in range(7):
            for fast in ("auto", False):
                with spec_ext.models.attention_implementation(target, fast_linear=fast):
                    cache = spec_ext.SpecCache.for_model(target, 1, L + max(args.widths) + 1)
                    spec_ext.models.forward(target, prompt, cache, torch.arange(L)[None])
                    cache.advance([L])
                    for w in args.widths:
                        new = prompt.repeat(1, -(-w // L))[:, :w]
                        start = time.perf_counter()
                        spec_ext.models.forward(target, new, cache, L + torch.arange(w)[None])
                        times[fast, w].append(time.perf_counter() - start)
    verify = []
    for fast in ("auto", False):
        one = min(times[fast, 1])
        for w in args.widths:
            best = min(times[fast, w])
            verify.append(dict(fast_linear=fast, width=w, best_ms=round(best * 1e3, 2),
                               median_ms=round(statistics.median(times[fast, w]) * 1e3, 2),
                               over_one_step=round(best / one, 3)))
            print(f"fast_linear={fast!s:5} width {w:2d}: {best * 1e3:7.2f} ms = {best / one:.2f} x one step")

    # B=1 greedy, methods interleaved per prompt
    n = args.new_tokens
    methods = {"target alone, lean forward, fast_linear": None, "target alone, lean forward": None,
               "head fixed k=4": (head, spec_ext.policies.Fixed(4)), "head auto": (head, "auto")}
    methods |= {f"draft fixed k={k}": (draft, spec_ext.policies.Fixed(k)) for k in args.draft_k}
    methods["draft auto"] = (draft, "auto")
    rates = {m: [] for m in methods}
    accepted = {m: [] for m in methods}
    for _ in range(args.repeats):
        for p in prompts:
            expected = None
            for m, spec in methods.items():
                start = time.perf_counter()
                if spec is None:
                    out = lean_alone(target, [p], n, 0.0, "auto" if m.endswith("fast_linear") else False)
                    seq = out[0, len(p):].tolist()
                else:
                    res = spec_ext.generate(target, spec[0], [p], max_new_tokens=n, eos_token_id=[], policy=spec[1])
                    seq = res.sequences[0, len(p):].tolist()
                    st = res.stats
                    accepted[m].append(st.accepted / max(1, st.rounds))
                elapsed = time.perf_counter() - start
                expected = seq if expected is None else expected
                assert seq == expected, f"{m}: greedy output differs from the target alone's"
                rates[m].append(n / elapsed)
    base = rates["target alone, lean forward, fast_linear"]
    rows = []
    for m, r in rates.items():
        ratios = [a / b for a, b in zip(r, base)]
        rows.append(dict(method=m, tokens_per_s=round(statistics.median(r), 1),
                         speedup_vs_target_fast=round(statistics.median(ratios), 3),
                         spread=f"{min(ratios):.2f}-{max(ratios):.2f}",
                         accepted_per_round=round(statistics.mean(accepted[m]), 2) if accepted[m] else ""))
        print(f"{m:42} {rows[-1]['tokens_per_s']:7.1f} tok/s  {rows[-1]['speedup_vs_target_fast']:.2f}x "
              f"({rows[-1]['spread']})  accepted/round {rows[-1]['accepted_per_round']}")
    load_after = os.getloadavg()[0]
    common = dict(batch=1, new_tokens=n, prompts=len(prompts), passes=args.repeats, threads=args.threads,
                  target_read_mb=round(read_bytes(target) / 1e6, 1), load_before=f"{load_before:.2f}",
                  load_after=f"{load_after:.2f}", isa=spec_ext.ops.linear.cpu_isa())
    for name, table in ((args.name, rows), (args.name + "_verify", verify)):
        with open(out_dir / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]) + list(common))
            writer.writeheader()
            writer.writerows([r | common for r in table])
    print(f"load after {load_after:.2f}; wrote {out_dir / args.name}.csv and _verify.csv")


if __name__ == "__main__":
    main()
