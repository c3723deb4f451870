"""SpecCache: a preallocated KV cache with per-row lengths, for ragged speculative batches.

All layers' keys and values live in one buffer [2L, B, H, S, D] (layer l's K at 2l, V at
2l+1), so a tree commit moves every layer's accepted path in one ``compact_kv`` launch. Where
values are another width than keys (MLA: DeepSeek-V3's keys are ``qk_nope_head_dim +
qk_rope_head_dim`` wide, its values ``v_head_dim``) keys and values have a buffer each,
[L, B, H, S, D] and [L, B, H, S, Dv] (``buffers``; a commit is one launch per buffer).
``update()`` writes the new tokens of a forward at each row's own offset
(``lengths[b] + j``) without changing the lengths: the decoding loop decides what to keep
with :meth:`advance` (chains), :meth:`commit` (trees), :meth:`rollback` and
:meth:`keep_rows`; :meth:`reserve` grows the capacity.

A target split across ranks by transformers' tensor parallelism keeps only its local KV
heads here; on the rank that leads the loop its cache is a :class:`MirroredCache`, which
sends each change, and each forward over it, to the other ranks before making it.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import weakref
from typing import Callable, Sequence

import torch
from torch import Tensor

from transformers.cache_utils import Cache

from spec_ext import ops


class SpecCache(Cache):
    """KV cache of one model for B rows of up to ``capacity`` tokens each.

    Args:
        num_layers: the model's attention layers.
        num_kv_heads, head_dim: the shape of the keys its attention writes; None: taken from
            the first keys :meth:`update` is given (the buffer is allocated then).
        batch_size: B. capacity: S, tokens per row. dtype, device: of the buffers.
        value_head_dim: the values' head size where it differs from the keys' (None: the same,
            or, for an unsized cache, taken from the first values).

    ``buffers`` holds the cache: one [2L,B,H,S,D] tensor (``buffer``), or the keys
    [L,B,H,S,D] and the values [L,B,H,S,Dv] where their widths differ (``buffer`` is then
    the keys').

    Example:
        >>> cache = SpecCache(num_layers=2, num_kv_heads=4, head_dim=16, batch_size=3, capacity=64)
        >>> k = torch.randn(3, 4, 5, 16)
        >>> _ = cache.update(k, k, 0); _ = cache.update(k, k, 1)
        >>> cache.advance([5, 2, 0]); cache.lengths.tolist()
        [5, 2, 0]
    """

    def __init__(self, num_layers: int, num_kv_heads: int | None, head_dim: int | None, batch_size: int,
                 capacity: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 value_head_dim: int | None = None):
        super().__init__(layers=[])
        if (num_kv_heads is None) != (head_dim is None):
            raise ValueError(f"num_kv_heads, head_dim: give both or neither (None: sized by the first update), "
                             f"got {num_kv_heads}, {head_dim}")
        self.num_layers = num_layers
        self.capacity = capacity
        self._sized = num_kv_heads is not None  # False until update() sees the first keys
        self._set_buffers(self._allocate(torch.zeros(0, dtype=dtype, device=device), batch_size, num_kv_heads or 0,
                                         capacity, head_dim or 0, value_head_dim))
        self._set([0] * batch_size)

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int) -> "SpecCache":
        """A cache for ``model``, sized by the keys its attention writes at the first forward
        (the number of KV heads in a config is not always what the attention uses: GPT-2
        and GPT-NeoX ignore a ``num_key_value_heads`` that a saved config may carry, and a
        model split by tensor parallelism writes only its local heads); a
        :class:`MirroredCache` while :func:`mirrored` says this rank leads ``model``."""
        config, split = model.config, split_size(model)
        if split > 1:  # an architecture transformers splits names its KV heads in its config
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            if kv_heads % split:
                raise ValueError(f"{type(model).__name__}: {kv_heads} key-value heads do not split evenly across "
                                 f"tp_size={split} ranks")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a multimodal model's text
        shape = (text.num_hidden_layers, None, None, batch_size, capacity)
        send = _SENDERS.get(model)
        if send is not None:
            return MirroredCache(send, *shape, dtype=model.dtype, device=model.device)
        return cls(*shape, dtype=model.dtype, device=model.device)

    def _allocate(self, like: Tensor, batch_size: int, heads: int, capacity: int, head_dim: int,
                  value_head_dim: int | None) -> tuple[Tensor, ...]:
        L = self.num_layers
        if value_head_dim is None or value_head_dim == head_dim:
            return (like.new_zeros(2 * L, batch_size, heads, capacity, head_dim),)
        return (like.new_zeros(L, batch_size, heads, capacity, head_dim),
                like.new_zeros(L, batch_size, heads, capacity, value_head_dim))

    def _size(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate the buffers for the shapes of the first keys and values written (no row
        holds a token yet, so nothing is lost)."""
        _, batch_size, _, capacity, _ = self.buffer.shape
        self._set_buffers(self._allocate(self.buffer, batch_size, key_states.shape[1], capacity, key_states.shape[3],
                                         value_states.shape[3]))
        self._sized = True

    # ------------------------------------------------------------- transformers API
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write [B,H,T,D] new keys/values at positions lengths[b] + j; return views of the
        layer's buffers [B,H,longest + T,D], cut to the keys that can be seen (the longest
        row + T, known on the host: attention then reads no further and needs no sync)."""
        if not self._sized:
            self._size(key_states, value_states)
        keys, values = self._layers[layer_idx]
        if key_states.shape[1] != keys.shape[1] or key_states.shape[3] != keys.shape[3] or \
                value_states.shape[:3] != key_states.shape[:3] or value_states.shape[3] != values.shape[3]:
            raise ValueError(f"SpecCache: layer {layer_idx} writes keys {tuple(key_states.shape)} and values "
                             f"{tuple(value_states.shape)}, but the cache holds {keys.shape[1]} heads of "
                             f"{keys.shape[3]} key dims and {values.shape[3]} value dims (the same on every layer)")
        T = key_states.shape[2]
        if self._longest + T > self.capacity:
            raise ValueError(f"SpecCache: a row would exceed the capacity of {self.capacity} tokens "
                             f"(lengths {self.host_lengths} + {T} new); allocate a larger cache or reserve() more")
        if self._common_length is not None:
            start = self._common_length
            keys[:, :, start:start + T] = key_states
            values[:, :, start:start + T] = value_states
        else:
            if self._scatter is None or self._scatter[1].shape[1] != T:  # the same for every layer of a forward
                rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1)
                self._scatter = rows, self.lengths.unsqueeze(1) + torch.arange(T, device=keys.device)
            rows, positions = self._scatter
            keys[rows, :, positions] = key_states.transpose(1, 2)
            values[rows, :, positions] = value_states.transpose(1, 2)
        seen = self._longest + T
        return keys[:, :, :seen], values[:, :, :seen]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._longest

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    def before_forward(self, input_ids: Tensor, positions: Tensor, tree_mask: Tensor | None) -> None:
        """Called by :func:`spec_ext.models.forward` before a model runs over this cache
        (a :class:`MirroredCache` announces the forward to the other ranks)."""

    # ------------------------------------------------------------- speculative API
    @property
    def batch_size(self) -> int:
        return self.buffer.shape[1]

    def _set_buffers(self, buffers: tuple[Tensor, ...]) -> None:
        self.buffers, self.buffer = tuple(buffers), buffers[0]
        keys, values = (buffers[0][0::2], buffers[0][1::2]) if len(buffers) == 1 else buffers
        self._layers = list(zip(keys.unbind(0), values.unbind(0)))  # (K, V) views per layer

    def _set(self, lengths: Sequence[int], device_lengths: Tensor | None = None) -> None:
        """New lengths: ``lengths`` on the host and, when the caller has them, the same on the
        device (``device_lengths``). Without them a change by the same amount for every row
        is made on the device; anything else is copied from the host. On a GPU a copy from
        the host waits for the queue, so the loops pass device lengths to keep one host sync
        per round."""
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch_size:
            raise ValueError(f"lengths: expected {self.batch_size} entries, got {len(lengths)}")
        if any(n < 0 or n > self.capacity for n in lengths):
            raise ValueError(f"lengths: every entry must be in [0, {self.capacity}], got {lengths}")
        old = getattr(self, "host_lengths", None)
        if device_lengths is None and old is not None and len(old) == len(lengths) and lengths:
            deltas = {new - before for new, before in zip(lengths, old)}
            if len(deltas) == 1:
                device_lengths = self.lengths + deltas.pop()
        self.host_lengths = lengths
        self.lengths = (torch.tensor(lengths, dtype=torch.int64, device=self.buffer.device) if device_lengths is None
                        else device_lengths.to(torch.int64))
        # update() runs once per layer per forward: decide its write path once here
        self._longest = max(lengths, default=0)
        self._common_length = lengths[0] if lengths and lengths.count(lengths[0]) == len(lengths) else None
        self._scatter = None  # update()'s write positions of ragged rows, made by its first layer

    def advance(self, counts: Sequence[int] | Tensor, device_counts: Tensor | None = None) -> None:
        """Keep ``counts[b]`` more tokens of row b (written by the last update, in order);
        ``device_counts``: the same counts on the cache's device, when the caller has them."""
        counts = counts.tolist() if isinstance(counts, Tensor) else counts
        self._set([n + c for n, c in zip(self.host_lengths, counts)],
                  None if device_counts is None else self.lengths + device_counts)

    def rollback(self, lengths: Sequence[int] | Tensor, device_lengths: Tensor | None = None) -> None:
        """Shrink rows to ``lengths`` (each at most its current length; ``device_lengths``: the
        same on the cache's device, when the caller has them)."""
        lengths = lengths.tolist() if isinstance(lengths, Tensor) else list(lengths)
        if len(lengths) != self.batch_size or any(new > old for new, old in zip(lengths, self.host_lengths)):
            raise ValueError(f"lengths: rollback needs {self.batch_size} entries each <= the current "
                             f"{self.host_lengths}, got {lengths}")
        self._set(lengths, device_lengths)

    def commit(self, path: Tensor, num_accepted: Tensor | Sequence[int],
               device_accepted: Tensor | None = None) -> None:
        """Keep a verified tree's accepted path. The last forward wrote node i of row b at
        ``lengths[b] + i``; ``path[b, :num_accepted[b] + 1]`` (root first) is compacted to
        ``lengths[b] + 0..num_accepted[b]`` for every layer in one launch, and the rows grow
        by ``num_accepted + 1`` (``device_accepted``: num_accepted on the cache's device,
        when the caller has it). A chain is the path 0, 1, 2, ... and moves nothing."""
        accepted = num_accepted.tolist() if isinstance(num_accepted, Tensor) else list(num_accepted)
        path = path.to(self.buffer.device)
        if device_accepted is None:
            device_accepted = torch.tensor(accepted, device=path.device)
        keep = torch.arange(path.shape[1], device=path.device) <= device_accepted[:, None]
        src = torch.where(keep & (path >= 0), self.lengths[:, None] + path, -1)
        for buffer in self.buffers:
            ops.compact_kv(buffer, src, self.lengths, validate=False)
        self.advance([a + 1 for a in accepted], device_accepted + 1)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``dst[i]`` becomes a copy of row ``src[i]`` (contents and length): a branch
        that shares its parent's prefix."""
        lengths = list(self.host_lengths)
        width = max(lengths[s] for s in src)
        for buffer in self.buffers:
            buffer[:, list(dst), :, :width] = buffer[:, list(src), :, :width]
        for s, d in zip(src, dst):
            lengths[d] = lengths[s]
        self._set(lengths)

    def keep_rows(self, rows: Sequence[int] | Tensor) -> None:
        """Keep only ``rows`` (e.g. drop finished sequences); copies the buffer once."""
        rows = rows.tolist() if isinstance(rows, Tensor) else list(rows)
        index = torch.tensor(rows, dtype=torch.int64, device=self.buffer.device)
        lengths = self.lengths[index]
        self._set_buffers(tuple(buffer.index_select(1, index) for buffer in self.buffers))
        self._set([self.host_lengths[i] for i in rows], lengths)

    def reserve(self, length: int) -> None:
        """Grow the capacity, keeping what every row holds, so that a row can hold ``length``
        tokens (at least doubled, so that growing by a little at a time copies seldom)."""
        if length <= self.capacity:
            return
        capacity = max(int(length), 2 * self.capacity)
        grown = tuple(buffer.new_zeros(*buffer.shape[:3], capacity, buffer.shape[4]) for buffer in self.buffers)
        for new, old in zip(grown, self.buffers):
            new[:, :, :, :self.capacity] = old
        self.capacity = capacity
        self._set_buffers(grown)


def split_size(model) -> int:
    """How many ranks ``model`` is split across by transformers' tensor parallelism (1: none)."""
    return int(getattr(model, "_tp_size", None) or 1)


_SENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def mirrored(model, send: Callable[[tuple], None]):
    """While inside, :meth:`SpecCache.for_model` gives ``model`` a :class:`MirroredCache`
    that hands its messages to ``send``."""
    _SENDERS[model] = send
    try:
        yield
    finally:
        _SENDERS.pop(model, None)


def _announced(host_args: int):
    """Queue the call for the other ranks with its first ``host_args`` arguments (the rest
    are device copies of them, which the others make themselves), unless it is made by
    another announced call; then make it."""
    def wrap(method):
        @functools.wraps(method)
        def announced(self, *args, **kwargs):
            if not self._replaying:
                sent = tuple(a.cpu() if isinstance(a, Tensor) else int(a) if isinstance(a, numbers.Integral)
                             else list(a) for a in args[:host_args])
                self._pending.append((method.__name__, sent))
            self._replaying += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                self._replaying -= 1
        return announced
    return wrap


class MirroredCache(SpecCache):
    """The leading rank's cache of a tensor-parallel target. Changes are queued and sent
    with the next forward, as one message ``("step", changes, input_ids, positions,
    tree_mask)``, so that every rank's cache holds the same rows and lengths and every rank
    runs the same forwards (and so the same collectives) in the same order. Messages:
    ``("cache", *shape)`` on creation, then the steps; see
    ``spec_ext.engine.tensor_parallel`` for the other end. Only the host-side arguments
    travel (device copies of them are rebuilt there)."""

    def __init__(self, send: Callable[[tuple], None], num_layers: int, num_kv_heads: int, head_dim: int,
                 batch_size: int, capacity: int, **kwargs):
        self._send, self._pending, self._replaying = send, [], 0
        super().__init__(num_layers, num_kv_heads, head_dim, batch_size, capacity, **kwargs)
        send(("cache", num_layers, num_kv_heads, head_dim, batch_size, capacity))

    def before_forward(self, input_ids: Tensor, positions: Tensor, tree_mask: Tensor | None) -> None:
        pending, self._pending = self._pending, []
        self._send(("step", pending, input_ids.cpu(), positions.cpu(),
                    None if tree_mask is None else tree_mask.cpu()))

    @_announced(1)
    def advance(self, counts, device_counts=None):
        super().advance(counts, device_counts)

    @_announced(1)
    def rollback(self, lengths, device_lengths=None):
        super().rollback(lengths, device_lengths)

    @_announced(2)
    def commit(self, path, num_accepted, device_accepted=None):
        super().commit(path, num_accepted, device_accepted)

    @_announced(2)
    def copy_rows(self, src, dst):
        super().copy_rows(src, dst)

    @_announced(1)
    def keep_rows(self, rows):
        super().keep_rows(rows)

    @_announced(1)
    def reserve(self, length):
        super().reserve(length)
