"""Speculative decoding with a target split across ranks by transformers' tensor parallelism.

Under ``torchrun --nproc-per-node N`` every rank loads the target with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`` and the draft
whole, and calls ``generate`` with the same arguments. Tensor-parallel rank 0 leads: it
drafts, verifies and samples exactly as a single process does (its uniforms are the only
ones drawn), and its target cache (:class:`spec_ext.models.MirroredCache`) sends every
target forward, with the cache changes before it, to the other ranks, which replay them on
their shards (:func:`Channel.follow`). So every rank runs the same forwards, and so the same
collectives, in the same order, and nothing a follower computes decides anything: no rank
can diverge. The leader ends with the output, and every rank returns the same
:class:`~spec_ext.engine.common.Output`. The draft runs on the leader only (the others'
draft is checked, then left alone): a replicated draft would save one small broadcast per
target forward but needs the same agreement on what it drafted, since a sampled draft on
another rank draws other tokens.

Faults: every rank waits at most ``SPEC_EXT_TP_TIMEOUT`` seconds (default 120) for the others
to reach ``generate`` (their first call makes the channel), a follower as long for the
leader's next message, and a rank that dies breaks the others' collectives at once; each way
the others raise :class:`PeerError`. A rank that stalls inside a target forward holds the
others in that forward's collectives until the process group's own timeout.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import time
import weakref
from datetime import timedelta

import torch

from spec_ext.engine.common import Output
from spec_ext.engine.parallel.messages import PeerError
from spec_ext.models import SpecCache, attention_implementation, forward, mirrored, split_size

TIMEOUT_VARIABLE = "SPEC_EXT_TP_TIMEOUT"
SMALL = 8192  # bytes: a message that fits travels in one broadcast of this size, a bigger one in two

_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MADE = itertools.count()  # channels this process has begun to make: every rank makes them in one order


def channel(target) -> "Channel | None":
    """The leader -> followers channel of a split ``target`` (made on the first call, by
    every rank: it creates a process group), or None when the target is whole."""
    if split_size(target) == 1:
        return None
    if target not in _CHANNELS:
        _CHANNELS[target] = Channel(target)
    return _CHANNELS[target]


class Channel:
    """Pickled messages from the leading rank to the other ranks of one tensor-parallel
    group, by broadcast on a gloo group of those ranks (on the CPU, with a timeout)."""

    def __init__(self, target):
        import torch.distributed as dist

        mesh = target._device_mesh
        if mesh.size() != split_size(target):
            raise ValueError(f"target: split over a mesh of {mesh.size()} ranks, {split_size(target)} of them by "
                             "tensor parallelism; spec_ext runs targets split by tensor parallelism only "
                             "(pipeline, FSDP and data-parallel sizes 1)")
        self.ranks = dist.get_process_group_ranks(mesh["tp"].get_group())
        self.leader = self.ranks[0]
        self.leading = dist.get_rank() == self.leader
        self.timeout = float(os.environ.get(TIMEOUT_VARIABLE, "120"))
        _wait_for_ranks(self.ranks, self.timeout, next(_MADE))
        try:
            self.group = dist.new_group(self.ranks, backend="gloo", timeout=timedelta(seconds=self.timeout))
        except Exception as error:  # noqa: BLE001 - a rank that arrived and then died or stalled
            raise PeerError(f"tensor parallelism: making the channel between ranks {self.ranks} failed ({error}); "
                            "no output is returned") from error
        self.seconds = 0.0  # spent in this channel's broadcasts (a benchmark reads it)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist
        started = time.perf_counter()
        dist.broadcast(tensor, self.leader, group=self.group)
        self.seconds += time.perf_counter() - started

    def send(self, message: tuple) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        head = torch.zeros(SMALL, dtype=torch.uint8)
        head[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        small = len(payload) <= SMALL - 8
        if small:
            head[8:8 + len(payload)] = payload
        try:
            self._broadcast(head)
            if not small:
                self._broadcast(payload)
        except Exception as error:  # noqa: BLE001 - any transport failure means a follower is gone
            raise PeerError(f"tensor parallelism: sending to ranks {self.ranks[1:]} failed ({error}); "
                            "no output is returned") from error

    def receive(self) -> tuple:
        head = torch.zeros(SMALL, dtype=torch.uint8)
        try:
            self._broadcast(head)
            size = int(head[:8].view(torch.int64))
            payload = head[8:8 + size]
            if size > SMALL - 8:
                payload = torch.empty(size, dtype=torch.uint8)
                self._broadcast(payload)
        except Exception as error:  # noqa: BLE001
            raise PeerError(f"tensor parallelism: the leading rank {self.leader} sent nothing for "
                            f"{self.timeout:g} s ({TIMEOUT_VARIABLE}) or died ({error}); no output is returned"
                            ) from error
        return pickle.loads(payload.numpy().tobytes())

    @contextlib.contextmanager
    def leading_run(self, target):
        """On the leader, around building and running the engine: the target's caches are
        mirrored; a failure is passed on to the followers (and a broken collective becomes
        a PeerError naming the ranks)."""
        try:
            with mirrored(target, self.send):
                yield
        except PeerError:
            raise
        except Exception as error:
            with contextlib.suppress(Exception):
                self.send(("failed", f"{type(error).__name__}: {error}"))
            if _is_transport_error(error):
                raise PeerError(f"tensor parallelism: a target forward's collective failed ({error}): a rank of "
                                f"{self.ranks[1:]} died or stalled; no output is returned") from error
            raise

    def finish(self, output: Output) -> None:
        self.send(("done", output.sequences.cpu(), output.stats))

    def follow(self, target) -> Output:
        """On every other rank: replay the leader's cache changes and target forwards on
        this rank's shard until it sends the output, and return that."""
        cache, device = None, target.device
        with attention_implementation(target):
            while True:
                message = self.receive()
                kind = message[0]
                if kind == "cache":
                    cache = SpecCache(*message[1:], dtype=target.dtype, device=device)
                elif kind == "step":
                    _, changes, input_ids, positions, tree_mask = message
                    for name, args in changes:
                        getattr(cache, name)(*args)
                    try:
                        forward(target, input_ids.to(device), cache, positions.to(device),
                                None if tree_mask is None else tree_mask.to(device))
                    except Exception as error:
                        if _is_transport_error(error):
                            raise PeerError(f"tensor parallelism: a target forward's collective failed ({error}): "
                                            "another rank died or stalled; no output is returned") from error
                        raise
                elif kind == "done":
                    return Output(message[1].to(device), message[2])
                elif kind == "failed":
                    raise PeerError(f"tensor parallelism: the leading rank {self.leader} failed: {message[1]} "
                                    "(no output is returned)")


def _wait_for_ranks(ranks: list[int], timeout: float, number: int) -> None:
    """Each rank of ``ranks`` says in the default store that it is making channel ``number``,
    then waits up to ``timeout`` seconds for the others to say so: a rank that never reaches
    ``generate`` is named in a PeerError, rather than breaking the process group's own
    rendezvous later with a store error that names no one."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"spec_ext/tensor_parallel/channel{number}/rank"
    rank = dist.get_rank()
    store.set(f"{key}{rank}", "1")
    others = [r for r in ranks if r != rank]
    try:
        store.wait([f"{key}{r}" for r in others], timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - a store timeout; which ranks are missing is read below
        missing = [r for r in others if not store.check([f"{key}{r}"])]
        if missing:
            raise PeerError(f"tensor parallelism: rank{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(map(str, missing))} did not reach generate within {timeout:g} s "
                            f"({TIMEOUT_VARIABLE}; every rank of {ranks} calls generate with the same "
                            "arguments); no output is returned") from error


def _is_transport_error(error: Exception) -> bool:
    import torch.distributed as dist
    return isinstance(error, dist.DistError) or "gloo" in str(error).lower() or "nccl" in str(error).lower()
