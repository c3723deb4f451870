"""Which backend serves an op, and the switch for input checks.

Backends: ``torch`` (spec_ext.reference), ``cpu`` (C++, spec_ext._C), ``cuda`` (CUDA,
spec_ext._C), ``triton`` (spec_ext.kernels), ``sdpa`` (tree_attention through PyTorch's
scaled_dot_product_attention, spec_ext.ops.sdpa). Every op resolves its backend through
:func:`kernel`: ``backend="auto"`` follows the measured table of
:mod:`spec_ext.ops.selection` where it has entries for the device and op (:func:`explain`
says which and why), else cuda > triton > torch for CUDA tensors and cpu > torch for CPU
tensors, among the backends the op has; SPEC_EXT_AUTO_TABLE=0 (read at each call) switches
the table off.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Callable

import torch
from torch import Tensor

from spec_ext import reference
from spec_ext.ops import selection

BACKENDS = ("torch", "cpu", "triton", "cuda", "sdpa")
# dispatch keys each op has compiled kernels for, in a build with CUDA (skinny_linear: CPU
# only; on a GPU cuBLAS already reads skinny operands at full bandwidth; acceptance_head:
# CPU only, it fuses away per-op host overhead that a GPU hides behind its queue;
# tree_attention_invariant: tree_attention with every query's output independent of T, CPU
# only, called through ``spec_ext.tree_attention(..., invariant=True)``; on a GPU that is
# tree_attention's backend "triton_invariant")
KERNEL_KEYS = {"tree_mask": ("CPU", "CUDA"), "chain_verify": ("CPU", "CUDA"), "tree_verify": ("CPU", "CUDA"),
               "tree_attention": ("CPU", "CUDA"), "compact_kv": ("CPU", "CUDA"), "skinny_linear": ("CPU",),
               "acceptance_head": ("CPU",), "tree_attention_invariant": ("CPU",)}
OPS = tuple(KERNEL_KEYS)
# (op, backend) -> (module of spec_ext.kernels, function) of its Triton kernels. "triton_split"
# (tree_attention split over the keys, chain and greedy tree verification over the
# vocabulary) and "triton_invariant" (tree_attention and skinny_linear whose every query and
# row is independent of how many share the call) have not run on a GPU yet: opt-in, never
# chosen by "auto".
from spec_ext.kernels.launch import LAUNCHERS as TRITON_KERNELS  # noqa: E402 - the one table, beside its launchers
# (op, backend) -> function of spec_ext.ops.sdpa: runs on every device PyTorch runs on
SDPA_KERNELS = {("tree_attention", "sdpa"): "tree_attention"}

try:
    from spec_ext import _C  # registers the spec_ext:: kernels
    _C_ERROR = None
except ImportError as error:  # pragma: no cover - depends on the build
    _C = None
    _C_ERROR = f"spec_ext._C is not built or failed to load ({error})"
    warnings.warn(f"spec_ext: {_C_ERROR}. Only the torch and triton backends are available; "
                  "build the C++/CUDA kernels with `pip install --no-build-isolation -e .`",
                  RuntimeWarning, stacklevel=2)

_validate_default = True


def set_validation(enabled: bool) -> None:
    """Switch every op's input checks on or off (default on); ``validate=`` of a call wins."""
    global _validate_default
    _validate_default = bool(enabled)


def checking(validate: bool | None) -> bool:
    """Whether a call with this ``validate`` argument checks its inputs."""
    return _validate_default if validate is None else validate


def registered(op: str, key: str) -> bool:
    """Whether the compiled extension registered a kernel of ``spec_ext::op`` for ``key``."""
    if _C_ERROR is not None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"spec_ext::{op}", key)


@functools.lru_cache(None)
def _triton_status() -> str | None:
    """None when the Triton kernels can run on this machine, else why not."""
    try:
        importlib.import_module("spec_ext.kernels.tree")
    except ImportError as error:
        return f"Triton kernels cannot be imported ({error})"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run them on CPU)"
    return None


def backends() -> dict[str, str]:
    """Each backend's status: ``"available"`` or ``"unavailable: <reason>"``."""
    def status(reason):
        return "available" if reason is None else f"unavailable: {reason}"
    cpu_missing = [op for op in OPS if not registered(op, "CPU")]
    cuda_missing = [op for op in OPS if "CUDA" in KERNEL_KEYS[op] and not registered(op, "CUDA")]
    cuda_reason = _C_ERROR or (f"CUDA kernels not built ({', '.join(cuda_missing)} missing)" if cuda_missing
                               else None if torch.cuda.is_available() else "built, but no CUDA device")
    return {
        "torch": status(None),
        "cpu": status(_C_ERROR or (f"missing CPU kernels: {cpu_missing}" if cpu_missing else None)),
        "triton": status(_triton_status()),
        "cuda": status(cuda_reason),
        "sdpa": status(None),
    }


def backends_of(op: str) -> tuple[str, ...]:
    """The backends ``op`` has (whether or not they can run here)."""
    triton = tuple(backend for (name, backend) in TRITON_KERNELS if name == op)
    sdpa = tuple(backend for (name, backend) in SDPA_KERNELS if name == op)
    torch_ = ("torch",) if hasattr(reference, op) else ()  # tree_attention_invariant has no reference of its own
    return torch_ + tuple(key.lower() for key in KERNEL_KEYS[op]) + triton + sdpa


def _fixed_order(op: str, device: torch.device) -> str:
    """``auto`` where the table has nothing: cuda > triton > torch on CUDA, cpu > torch on CPU."""
    if device.type == "cuda":
        if registered(op, "CUDA"):
            return "cuda"
        return "triton" if (op, "triton") in TRITON_KERNELS and _triton_status() is None else "torch"
    return "cpu" if device.type == "cpu" and registered(op, "CPU") else "torch"


def _cannot_run(op: str, backend: str, device: torch.device) -> str | None:
    try:
        resolve(op, backend, device)
    except ValueError as error:
        return str(error)
    return None


# os.environ's own store, read directly: os.environ.get of an unset variable costs ~0.6 us
# (a KeyError raised and caught), the store's dict.get ~0.05 us; the same contents (setting
# os.environ writes both), a public fallback where CPython's layout differs
_ENVIRON = getattr(os.environ, "_data", None)
try:
    _SWITCH_KEY, _SWITCH_OFF = os.environ.encodekey(selection.SWITCH), os.environ.encodevalue("0")
except AttributeError:  # pragma: no cover - not CPython's os._Environ
    _ENVIRON = None


def table_on() -> bool:
    """Whether ``auto`` follows the measured table of :mod:`spec_ext.ops.selection`: yes
    unless the environment variable SPEC_EXT_AUTO_TABLE is "0" (the fixed order, what
    ``auto`` took before the table; for before/after comparisons). Read at every call, so
    setting it within a process takes effect at the next call."""
    if _ENVIRON is None:  # pragma: no cover
        return os.environ.get(selection.SWITCH) != "0"
    return _ENVIRON.get(_SWITCH_KEY) != _SWITCH_OFF


def auto_choices(op: str, device: torch.device,
                 table: bool | None = None) -> tuple[tuple[str, selection.Entry | None], ...]:
    """What ``auto`` tries, in order: (backend, table entry) for the table's entries that
    can run on ``device``, up to the first that serves every call; the fixed order
    (entry None) closes the list when none does. ``table``: whether the table is on (None:
    :func:`table_on`, read now); off, only the fixed order."""
    return _auto_choices(op, device, table_on() if table is None else table)


@functools.lru_cache(None)
def _auto_choices(op: str, device: torch.device, table: bool) -> tuple[tuple[str, selection.Entry | None], ...]:
    chosen = []
    for entry in selection.entries(device.type, op) if table else ():
        if _cannot_run(op, entry.backend, device) is None:
            chosen.append((entry.backend, entry))
            if entry.applies is None:
                return tuple(chosen)
    return tuple(chosen) + ((_fixed_order(op, device), None),)


def resolve(op: str, backend: str, device: torch.device) -> str:
    """The backend that serves ``op`` for tensors on ``device``; ValueError naming
    ``backend`` when the one asked for cannot (cached: registrations are fixed once the
    extension is loaded). ``"auto"`` gives the backend it picks, or ``"auto"`` itself
    when the pick depends on the call (see :func:`explain`)."""
    return _resolve(op, backend, device, backend == "auto" and table_on())


@functools.lru_cache(None)
def _resolve(op: str, backend: str, device: torch.device, table: bool) -> str:
    choices = ("auto",) + backends_of(op)
    if backend not in choices:
        raise ValueError(f"backend must be one of {choices} for {op}, got {backend!r}")
    if backend == "auto":
        picks = _auto_choices(op, device, table)
        return picks[0][0] if len(picks) == 1 else "auto"
    if backend == "cpu" and (device.type != "cpu" or not registered(op, "CPU")):
        raise ValueError(f"backend='cpu' needs CPU tensors and the built extension "
                         f"(tensors on {device}; {backends()['cpu']})")
    if backend == "cuda" and (device.type != "cuda" or not registered(op, "CUDA")):
        raise ValueError(f"backend='cuda' needs CUDA tensors and the built CUDA kernels "
                         f"(tensors on {device}; {backends()['cuda']})")
    if backend.startswith("triton") and _triton_status() is not None:
        raise ValueError(f"backend={backend!r} is unavailable: {_triton_status()}")
    return backend


def uncut(x: Tensor) -> Tensor:
    """``x`` [B,H,S,D] as a contiguous tensor, without a copy when it is a view that cuts the
    keys of a contiguous [B,H,S',D] buffer (what SpecCache.update returns): the buffer
    itself, from which a kernel reads only the first S keys (its callers keep
    ``prefix_lens + T <= S``)."""
    if x.is_contiguous():
        return x
    B, H, S, D = x.shape
    batch, head, key, lane = x.stride()
    if lane != 1 or key != D or head % D or batch != H * head or head // D < S:
        return x.contiguous()
    full = (B, H, head // D, D)
    end = x.storage_offset() + (B - 1) * batch + H * head
    if end * x.element_size() > x.untyped_storage().nbytes():
        return x.contiguous()
    return x.as_strided(full, (batch, head, key, lane))


def _keys_in_place(function: Callable) -> Callable:
    """A tree_attention kernel that indexes contiguous keys and values, handed cut cache
    views as their buffers (no per-layer copy of the cache); SDPA and the reference take
    the views as they are."""
    def call(q, k, v, *rest):
        return function(q, uncut(k), uncut(v), *rest)
    call.__doc__ = function.__doc__
    return call


def _function(op: str, impl: str) -> Callable:
    if impl == "torch":
        return getattr(reference, op)
    if impl == "sdpa":
        return getattr(importlib.import_module("spec_ext.ops.sdpa"), SDPA_KERNELS[op, impl])
    if impl.startswith("triton"):
        module, name = TRITON_KERNELS[op, impl]
        function = getattr(importlib.import_module(f"spec_ext.kernels.{module}"), name)
    else:
        function = getattr(torch.ops.spec_ext, op)
    return _keys_in_place(function) if op.startswith("tree_attention") else function


def kernel(op: str, backend: str, device: torch.device) -> Callable:
    """The function that runs ``op`` on ``device`` with ``backend`` ("auto" or a name),
    unchecked, with the schema's arguments (csrc/ops.cpp). Where ``auto``'s pick depends on
    the call, a function that tests the table's conditions on the arguments' shapes and
    host-side values, then calls the first backend that applies. Cached per state of
    SPEC_EXT_AUTO_TABLE, which every "auto" call reads (:func:`table_on`)."""
    if backend != "auto":
        return _kernel(op, backend, device, False)
    on = _ENVIRON.get(_SWITCH_KEY) != _SWITCH_OFF if _ENVIRON is not None else table_on()  # table_on, inlined
    return _kernel(op, backend, device, on)


@functools.lru_cache(None)
def _kernel(op: str, backend: str, device: torch.device, table: bool) -> Callable:
    impl = _resolve(op, backend, device, table)
    if impl != "auto":  # "auto" with one pick: the very function that backend's name gives
        return _function(op, impl) if backend != "auto" else _kernel(op, impl, device, False)
    picks = tuple((entry.applies if entry else None, _function(op, name))
                  for name, entry in _auto_choices(op, device, table))

    def auto(*args):
        for applies, function in picks:
            if applies is None or applies(*args):
                return function(*args)
    auto.__doc__ = f"spec_ext {op} on {device}, backend 'auto' (spec_ext.ops.explain({op!r}) says what it picks)"
    return auto


def explain(op: str, device: str | torch.device = "cpu", call: tuple | None = None) -> str:
    """What ``backend="auto"`` picks for ``op`` on ``device`` and why: the table's entries in
    order (the shapes each serves, the benchmark rows it follows, the command that makes
    them, or why its backend cannot run here), or that the table is off
    (SPEC_EXT_AUTO_TABLE=0), then, when ``call`` (the kernel-level arguments, as
    :func:`kernel`'s function takes them) is given, the entry that call takes.

    Example:
        >>> print(explain("tree_attention", "cuda"))  # doctest: +SKIP
    """
    device = torch.device(device)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    lines = [f"{op} on {device.type}, backend='auto':"]
    on = table_on()
    table = selection.entries(device.type, op) if on else ()
    if not on:
        lines.append(f"  the measured table is off ({selection.SWITCH}=0): the fixed order serves every call")
    for n, entry in enumerate(table, 1):
        why_not = _cannot_run(op, entry.backend, device)
        lines.append(f"  {n}. {entry.backend}: {entry.shapes}" + (f" [cannot run here: {why_not}]" if why_not else ""))
        lines.append(f"     measured: {entry.rows}")
        lines.append(f"     command: {entry.command}")
    if not table or all(entry.applies is not None for entry in table):
        lines.append(f"  {len(table) + 1}. {_fixed_order(op, device)}: "
                     f"{'otherwise' if table else 'every call'}: the fixed order cuda > triton > cpu > torch "
                     f"({'nothing measured for this device class says otherwise' if on else 'the table is off'})")
    if call is not None:
        for name, entry in auto_choices(op, device, on):
            if entry is None or entry.applies is None or entry.applies(*call):
                lines.append(f"  this call: {name}" + (f" ({entry.shapes})" if entry else " (the fixed order)"))
                break
    return "\n".join(lines)
