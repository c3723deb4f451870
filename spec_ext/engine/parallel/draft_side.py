"""The draft side of a parallel run (see :mod:`spec_ext.engine.parallel`): in a thread of
the target's process, or serving another rank's generate calls (:func:`serve_draft`)."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from spec_ext.drafters import ModelDrafter, Sampler
from spec_ext.engine.parallel.links import DistributedLink, send_pickled
from spec_ext.engine.parallel.messages import Done, Drafts, End, Failure, Hello, PeerError, Shutdown, Start, Verdict
from spec_ext.models import attention_implementation, check_model
from spec_ext.policies import BranchHint


def serve_draft(draft, target_rank: int = 0, timeout: float = 600.0, group=None) -> None:
    """Run the draft side of ``PEARL(mode="distributed")`` (or ``SpecBranch``) generate
    calls made on ``target_rank`` until that rank calls :func:`shutdown` (or dies: then
    PeerError). Between calls it waits as long as it takes; within a call, ``timeout``
    seconds of silence from the target rank raise PeerError.

    Example (one script, ``torchrun --nproc-per-node 2 script.py``):
        >>> dist.init_process_group("gloo")                                   # doctest: +SKIP
        >>> if dist.get_rank() == 1:                                          # doctest: +SKIP
        ...     spec_ext.serve_draft(draft)
        ... else:
        ...     out = spec_ext.generate(target, None, ids, policy=PEARL(mode="distributed"))
        ...     spec_ext.shutdown()
    """
    link = DistributedLink(target_rank, timeout, "target", (Shutdown,), group)
    while True:
        if serve_one(draft, link, raise_errors=True) == "shutdown":
            return


def shutdown(draft_rank: int = 1, group=None) -> None:
    """Tell the draft rank's :func:`serve_draft` to return."""
    send_pickled(Shutdown(), draft_rank, group)


def serve_one(draft, link, raise_errors: bool = False, threads: int | None = None):
    """One generate call's draft side; failures go to the target side (and are raised
    when ``raise_errors``)."""
    if threads is not None:
        torch.set_num_threads(threads)  # per calling thread for the OpenMP backend
    # in one process on a GPU the draft runs on its own CUDA stream, so its kernels overlap the target's
    stream = torch.cuda.Stream(draft.device) if threads is not None and draft.device.type == "cuda" else None
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return DraftSide(draft, link, stream).run()
    except BaseException as error:  # noqa: BLE001 - the target side must learn of any failure
        try:
            link.send(Failure(f"{type(error).__name__}: {error}"))
        except Exception:  # noqa: BLE001 - the link itself may be what failed
            pass
        if raise_errors:
            raise


@dataclass
class _Lane:
    slot: int              # the draft cache row it drafts in
    next_token: int        # fed at its next step
    history: set[int]      # node ids on its path since the row's root was last reset
    last: int              # its newest node (-1: the root)


class DraftSide:
    """Drafts every lane of every row one token per step; lane ``slot``s are rows of one
    SpecCache, ``branches`` per batch row."""

    def __init__(self, draft, link, stream=None):
        self.draft, self.link, self.stream = draft, link, stream
        # the lanes are rows of one drafter: its cache, forward and sampler (the lane logic is here)
        self.drafter = ModelDrafter(draft)

    def run(self):
        start = self.link.get(wait_forever=True)  # a serving rank may idle between generate calls
        if isinstance(start, Shutdown):
            return "shutdown"
        if not isinstance(start, Start):
            raise PeerError(f"expected a start message, got {type(start).__name__}")
        check_model(self.draft, "draft")  # on its own rank the target's generate call cannot check it
        self.link.send(Hello())
        self.start, self.device = start, self.draft.device
        self.sampler = Sampler(**start.sampling)
        self.generator = torch.Generator(device=self.device).manual_seed(start.seed)
        B, k = len(start.prompts), start.branches
        self.drafter.start([[]] * (B * k), start.capacity, self.sampler, self.generator)
        self.cache = self.drafter.cache
        self.lanes = {r: [_Lane(r * k, p[-1], set(), -1)] for r, p in enumerate(start.prompts)}
        self.free = {r: list(range(r * k + 1, (r + 1) * k)) for r in range(B)}
        self.epochs, self.next_node = [0] * B, [0] * B
        self.roots, self.hints = [-1] * B, [BranchHint.DEFER] * B  # each row's root node id, branch hint
        self.committed = [len(p) for p in start.prompts]
        with attention_implementation(self.draft, fast_linear=start.fast_linear, vocab_size=start.vocab_size), \
                torch.inference_mode():
            self._prefill()
            while True:
                live = [lane for r, lanes in self.lanes.items() for lane in lanes
                        if self.cache.host_lengths[lane.slot] + 1 - self.committed[r] < start.lookahead]
                messages = self.link.poll() if live else [self.link.get()]
                for message in messages:
                    if isinstance(message, End):
                        self.link.send(Done(self.drafter.calls))
                        return "done"
                    if not isinstance(message, Verdict):
                        raise PeerError(f"unexpected message from the target side: {type(message).__name__}")
                    self._apply(message)
                if not messages:
                    self._step(live)

    def _prefill(self) -> None:
        k = self.start.branches  # each row's first lane holds its prompt; the others start empty
        self.drafter.prefill([p[:-1] if slot % k == 0 else [] for p in self.start.prompts for slot in range(k)])

    def _apply(self, verdict: Verdict) -> None:
        lengths = list(self.cache.host_lengths)
        for r, length in verdict.committed.items():
            self.committed[r] = length
        for r, hint in verdict.hints.items():
            self.hints[r] = hint
        for r, node in verdict.moves.items():
            self._keep(r, [lane for lane in self.lanes[r] if node in lane.history])
            self.roots[r] = node
        for r, (epoch, node, token) in verdict.resets.items():
            lane = next(lane for lane in self.lanes[r] if node == -1 or node in lane.history)
            self._keep(r, [lane])
            lane.next_token, lane.history, lane.last = token, set(), -1
            self.roots[r] = -1
            lengths[lane.slot] = verdict.committed[r] - 1
            self.epochs[r], self.next_node[r] = epoch, 0
        self.cache.rollback([min(n, lengths[i]) for i, n in enumerate(self.cache.host_lengths)])
        for r in verdict.finished:
            self._keep(r, [])

    def _keep(self, r: int, lanes: list) -> None:
        self.free[r] += [lane.slot for lane in self.lanes[r] if lane not in lanes]
        self.lanes[r] = lanes

    def _step(self, live: list) -> None:
        started = time.perf_counter()
        slots = len(self.cache.host_lengths)
        ids = torch.zeros(slots, 1, dtype=torch.int64)
        for lane in live:
            ids[lane.slot, 0] = lane.next_token
        logits = self.drafter.forward(ids.to(self.device), self.cache.lengths[:, None]).logits[:, 0]
        advance = [0] * slots
        for lane in live:
            advance[lane.slot] = 1
        self.cache.advance(advance)
        index = torch.tensor([lane.slot for lane in live], device=self.device)
        logits = logits[index]
        confidence_probs = torch.softmax(logits, -1)
        first, q = self.sampler.propose(logits, self.generator)
        confidence = confidence_probs.gather(1, first[:, None])[:, 0].tolist()
        first = first.tolist()
        owner = {lane.slot: r for r, lanes in self.lanes.items() for lane in lanes}
        rows, nodes, parents, tokens, sources = [], [], [], [], []
        copies = []
        for i, lane in enumerate(live):
            r = owner[lane.slot]
            if self.hints[r] == BranchHint.ACCEPT_ALL:
                count = 1
            elif self.hints[r] == BranchHint.REJECT_ALL and lane.last == self.roots[r]:
                count = self.start.branches
            else:
                count = max(1, int(self.start.branches * (1 - confidence[i])))
            count = min(count, 1 + len(self.free[r]))
            if count > 1:
                if q is None:
                    siblings = torch.topk(logits[i], count).indices.tolist()[1:]
                else:
                    rest = q[i].clone()
                    rest[first[i]] = 0
                    count = min(count, 1 + int((rest > 0).sum()))
                    siblings = (torch.multinomial(rest, count - 1, replacement=False, generator=self.generator)
                                .tolist() if count > 1 else [])
            else:
                siblings = []
            parent = lane.last
            for token in [first[i]] + siblings:
                node = self.next_node[r]
                self.next_node[r] += 1
                rows.append(r), nodes.append(node), parents.append(parent), tokens.append(token), sources.append(i)
                if token == first[i]:
                    lane.next_token, lane.last = token, node
                    lane.history.add(node)
                else:
                    slot = self.free[r].pop()
                    copies.append((lane.slot, slot))
                    self.lanes[r].append(_Lane(slot, token, (lane.history - {lane.last}) | {node}, node))
        if copies:
            self.cache.copy_rows([src for src, _ in copies], [dst for _, dst in copies])
        q_sent = None if q is None else q[sources]
        if self.stream is not None:
            self.stream.synchronize()  # the target reads q_sent on its own stream
        self.link.send(Drafts(rows, [self.epochs[r] for r in rows], nodes, parents, tokens, q_sent,
                               time.perf_counter() - started))


def split_threads() -> tuple[int, int]:
    """(target, draft) intra-op threads for the threads mode: the cores split in half."""
    cores = os.cpu_count() or 2
    return max(1, cores - cores // 2), max(1, cores // 2)
