"""Launching the Triton kernels, or planning the launches without running them; and which
launcher serves which op (:data:`LAUNCHERS`).

Every launcher launches through this module's :func:`wrap_triton`. Outside :func:`planning`
it is ``torch.library.wrap_triton``. Inside, each launch is recorded (kernel, grid,
arguments, constexprs and launch options, as the launcher chose them) and nothing runs,
so a launcher called on meta tensors says what it would compile and launch on the
planned GPU: ``spec_ext/kernels/aot.py`` compiles exactly those launches ahead of time
(tests/test_triton_compile.py, benchmarks/gpu_static.py).

Example::

    q = torch.empty(1, 32, 8, 128, dtype=torch.bfloat16, device="meta")
    with planning(H200) as launches:
        tree_attention(q, k, v, prefix_lens, None, 0.088, 0, 0.0, None)  # k, v, prefix_lens: meta too
    launches[0].grid, launches[0].meta  # (1, 32, 1), {'CAUSAL': True, 'BLOCK_T': 16, ...}
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

import torch
from torch.library import wrap_triton as _torch_wrap_triton


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to plan launches for: ``arch`` = compute capability x 10 (90: sm_90), ``sms``
    = its streaming multiprocessors."""
    name: str
    arch: int
    sms: int


H200 = Target("H200", 90, 132)
A100 = Target("A100", 80, 108)

# (op, backend) -> (module of spec_ext.kernels, function): every Triton launcher and the op of
# spec_ext.ops it serves (same arguments as the op's schema, csrc/ops.cpp). The kernels say
# what they serve; the layers above read it: ``spec_ext.ops.registry`` dispatches to these
# launchers and spec_ext/kernels/aot.py compiles each one's launches. "triton_split" (tree_attention
# split over the keys, chain and greedy tree verification over the vocabulary) and
# "triton_invariant" (tree_attention and skinny_linear whose every query and row is the same
# bits whatever the call's width: docs/invariance.md) have not run on a GPU yet: the registry
# keeps them opt-in.
LAUNCHERS = {("tree_mask", "triton"): ("tree", "tree_mask"),
             ("chain_verify", "triton"): ("rejection_sampling", "chain_verify"),
             ("chain_verify", "triton_split"): ("rejection_sampling_split", "chain_verify_split"),
             ("tree_verify", "triton"): ("rejection_sampling", "tree_verify"),
             ("tree_verify", "triton_split"): ("rejection_sampling_split", "tree_verify_split"),
             ("tree_attention", "triton"): ("tree_attention", "tree_attention"),
             ("tree_attention", "triton_split"): ("tree_attention_split", "tree_attention_split"),
             ("tree_attention", "triton_invariant"): ("tree_attention_invariant", "tree_attention_invariant"),
             ("skinny_linear", "triton_invariant"): ("linear", "invariant_linear"),
             ("compact_kv", "triton"): ("kv_cache", "compact_kv")}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One planned kernel launch: ``meta`` holds the constexprs and launch options
    (num_warps, num_stages) exactly as the launcher passed them."""
    kernel: Any  # the @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    meta: dict

    @property
    def programs(self) -> int:
        count = 1
        for size in self.grid:
            count *= size
        return count


_plan: contextvars.ContextVar[tuple[Target, list[Launch]] | None] = contextvars.ContextVar("spec_ext_plan",
                                                                                            default=None)


@contextlib.contextmanager
def planning(target: Target) -> Iterator[list[Launch]]:
    """Within the block, launchers record their launches for ``target`` into the yielded
    list instead of launching; :func:`sm_count` and :func:`capability` report ``target``."""
    launches: list[Launch] = []
    token = _plan.set((target, launches))
    try:
        yield launches
    finally:
        _plan.reset(token)


class _Recorder:
    def __init__(self, kernel, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def record(*args, **meta):
            self.launches.append(Launch(self.kernel, tuple(grid), args, meta))
        return record


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)``, or within :func:`planning` a recorder of the
    launch. Named like torch's so that ``triton_op``'s scan of a launcher's source still
    finds the kernels it launches."""
    plan = _plan.get()
    if plan is None:
        return _torch_wrap_triton(kernel)
    return _Recorder(kernel, plan[1])


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the planned target's while planning; 4 for
    a CPU running the interpreter)."""
    plan = _plan.get()
    if plan is not None:
        return plan[0].sms
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def capability(device: torch.device) -> int | None:
    """Compute capability x 10 of ``device`` (the planned target's while planning), None off a GPU."""
    plan = _plan.get()
    if plan is not None:
        return plan[0].arch
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return None


def resident_per_sm(table: dict[int, int], device: torch.device) -> int:
    """A kernel's programs resident per SM on ``device``: ``table`` maps compute capability x
    10 to the count its compile reports (spec_ext/kernels/aot.py); 1 for a GPU not in it, or none."""
    return table.get(capability(device), 1)
