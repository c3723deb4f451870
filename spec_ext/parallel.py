"""Parallel speculative decoding (PEARL): the draft never waits for the target.

Two sides run at once and talk only through messages:
  * the draft side drafts one token per row per step, forever ahead of what is committed
    (up to a lookahead), and sends each step's tokens (and their distributions q);
  * the target side owns every decision and all verification randomness: each round it
    feeds the root and the first k queued drafts of every row (k = what is queued, at most
    ``gamma``), and when the forward is done verifies k+1 drafts with its k+1
    distributions, so the draft token that arrived during the forward is checked by the
    forward's last distribution (PEARL's pre-verify) while drafting went on meanwhile
    (post-verify). All k+1 accepted: nothing is sampled, the last draft is the next root
    and the draft carries on undisturbed. A rejection: the corrected token is the next
    root and that row of the draft is reset to it.
Each draft is tested exactly once, against the target distribution of its own prefix,
with a fresh uniform, so greedy output equals the target's and sampled output follows
the target's distribution whatever the timing (PEARL's published code reuses one
uniform for two tests and is not exact when sampling).

Modes: ``threads`` runs the draft side in a thread of this process (the cores split
between the two: torch intra-op threads are set to half each); ``distributed`` runs it
in another process of a torch.distributed group (gloo on CPU), rank ``draft_rank``
running :func:`serve_draft`. If the other side dies or stalls, the waiting side raises
within ``timeout`` seconds and no output is returned.
"""
from __future__ import annotations

import os
import pickle
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spec_ext import hf, ops
from spec_ext.cache import SpecCache
from spec_ext.policies import Policy, register


# ------------------------------------------------------------------ messages
@dataclass
class _Start:
    prompts: list[list[int]]
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    capacity: int
    lookahead: int


@dataclass
class _Hello:
    vocab_size: int


@dataclass
class _Drafts:
    rows: list[int]       # row ids (positions in the original batch)
    epochs: list[int]
    tokens: list[int]
    q: Tensor | None      # [len(rows), V] when sampling
    seconds: float        # the draft step's wall time


@dataclass
class _Verdict:
    committed: dict[int, int]                                   # row -> committed length
    resets: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (epoch, next root token)
    finished: list[int] = field(default_factory=list)


@dataclass
class _End:
    pass


@dataclass
class _Done:
    draft_calls: int


@dataclass
class _Shutdown:
    pass


@dataclass
class _Failure:
    error: str


class PeerError(RuntimeError):
    """The other side of a parallel run died, failed or stalled."""


# ------------------------------------------------------------------ links
class _Link:
    def __init__(self, inbox: queue.Queue, timeout: float, peer: str):
        self.inbox, self.timeout, self.peer = inbox, timeout, peer

    def _check(self, message):
        if isinstance(message, _Failure):
            raise PeerError(f"the {self.peer} side failed: {message.error} (no output is returned)")
        return message

    def get(self):
        """The next message; PeerError after ``timeout`` seconds of silence."""
        try:
            return self._check(self.inbox.get(timeout=self.timeout))
        except queue.Empty:
            raise PeerError(f"the {self.peer} side sent nothing for {self.timeout:g} s: it stalled or died "
                            "(no output is returned)") from None

    def poll(self) -> list:
        """Every message already here, without waiting."""
        messages = []
        while True:
            try:
                messages.append(self._check(self.inbox.get_nowait()))
            except queue.Empty:
                return messages


class _ThreadLink(_Link):
    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, timeout: float, peer: str):
        super().__init__(inbox, timeout, peer)
        self.outbox = outbox

    def send(self, message) -> None:
        self.outbox.put(message)


class _DistributedLink(_Link):
    """Pickled messages over torch.distributed send/recv; a daemon thread receives into
    the inbox until a message of type ``last`` arrives (or the peer fails)."""

    def __init__(self, peer_rank: int, timeout: float, peer: str, last: tuple[type, ...] = (), group=None):
        super().__init__(queue.Queue(), timeout, peer)
        self.peer_rank, self.group, self.last = peer_rank, group, last
        threading.Thread(target=self._receive, daemon=True, name=f"spec_ext-recv-{peer}").start()

    def send(self, message) -> None:
        import torch.distributed as dist
        payload = pickle.dumps(message)
        try:
            dist.send(torch.tensor([len(payload)]), self.peer_rank, group=self.group)
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.peer_rank, group=self.group)
        except Exception as error:  # noqa: BLE001 - any transport failure means the peer is gone
            raise PeerError(f"sending to the {self.peer} side (rank {self.peer_rank}) failed: {error}") from error

    def _receive(self) -> None:
        import torch.distributed as dist
        try:
            while True:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, self.peer_rank, group=self.group)
                data = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(data, self.peer_rank, group=self.group)
                message = pickle.loads(data.numpy().tobytes())
                self.inbox.put(message)
                if isinstance(message, self.last):
                    return
        except Exception as error:  # noqa: BLE001
            self.inbox.put(_Failure(f"rank {self.peer_rank}: {type(error).__name__}: {error}"))


# ------------------------------------------------------------------ the policy
@register
class PEARL(Policy):
    """Parallel speculative decoding (see the module docstring).

    Args:
        gamma: most drafts fed to one target forward; None picks it from the measured
            target-forward / draft-step time ratio after the first rounds.
        mode: ``"threads"`` or ``"distributed"`` (the draft model lives on ``draft_rank``,
            which runs :func:`serve_draft`; pass ``draft=None`` to generate).
        timeout: seconds without a message from the other side before giving up.
    """

    kind = "parallel"

    def __init__(self, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12):
        if gamma is not None and gamma < 1:
            raise ValueError(f"gamma: must be >= 1 or None (automatic), got {gamma}")
        if mode not in ("threads", "distributed"):
            raise ValueError(f"mode: expected 'threads' or 'distributed', got {mode!r}")
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self.gamma, self.mode, self.draft_rank, self.timeout = gamma, mode, draft_rank, timeout
        self.max_draft = max_gamma if gamma is None else gamma
        self.chosen_gamma: int | None = None

    @property
    def lookahead(self) -> int:
        return 2 * self.max_draft + 2

    def make_loop(self, target, draft, prompts, max_new_tokens, sampler, eos, generator, streamer):
        return _TargetSide(self, target, draft, prompts, max_new_tokens, sampler, eos, generator, streamer)


# ------------------------------------------------------------------ target side
class _TargetSide:
    def __init__(self, policy: PEARL, target, draft, prompts, max_new, sampler, eos, generator, streamer):
        from spec_ext.decoding import Stats
        self.policy, self.target, self.draft = policy, target, draft
        self.sampler, self.eos, self.generator, self.streamer = sampler, eos, generator, streamer
        self.device = target.device
        self.max_new = max_new
        self.prompts = prompts
        self.seqs = [list(p) for p in prompts]
        self.new: list[list[int]] = [[] for _ in prompts]
        self.active = list(range(len(prompts)))
        self.capacity = max(map(len, prompts)) + max_new + policy.lookahead + 2
        self.cache = SpecCache.for_model(target, len(prompts), self.capacity)
        self.stats = Stats()
        self.queues: dict[int, list[tuple[int, Tensor | None]]] = {r: [] for r in self.active}
        self.epochs = {r: 0 for r in self.active}
        self.forward_seconds: list[float] = []
        self.draft_seconds: list[float] = []

    def _gamma(self) -> int:
        if self.policy.gamma is not None:
            return self.policy.gamma
        if len(self.forward_seconds) < 2 or not self.draft_seconds:
            return 2
        ratio = statistics.median(self.forward_seconds[-16:]) / statistics.median(self.draft_seconds[-64:])
        return max(1, min(self.policy.max_draft, round(ratio)))

    def _receive(self, link, enough) -> None:
        """Queue drafts from the link until ``enough()`` holds (no wait when it already does)."""
        for message in link.poll():
            self._take(message)
        while not enough():
            self._take(link.get())

    def _take(self, message) -> None:
        if isinstance(message, _Drafts):
            self.draft_seconds.append(message.seconds)
            for i, (row, epoch, token) in enumerate(zip(message.rows, message.epochs, message.tokens)):
                if row in self.queues and epoch == self.epochs[row]:
                    self.queues[row].append((token, None if message.q is None else message.q[i]))
        elif isinstance(message, _Done):
            self.stats.draft_calls = message.draft_calls
        else:
            raise PeerError(f"unexpected message from the draft side: {type(message).__name__}")

    def run(self):
        link, worker = self._connect()
        saved_threads = torch.get_num_threads()
        if worker is not None:
            torch.set_num_threads(split_threads()[0])
        try:
            return self._run(link)
        except BaseException:
            try:
                link.send(_End())  # let a live draft side finish this call
            except PeerError:
                pass
            raise
        finally:
            torch.set_num_threads(saved_threads)
            if worker is not None:
                worker.join(timeout=self.policy.timeout)

    def _connect(self):
        if self.policy.mode == "threads":
            to_draft, to_target = queue.Queue(), queue.Queue()
            link = _ThreadLink(to_target, to_draft, self.policy.timeout, "draft")
            draft_link = _ThreadLink(to_draft, to_target, self.policy.timeout, "target")
            worker = threading.Thread(target=_serve_one, args=(self.draft, draft_link, False, split_threads()[1]),
                                      daemon=True, name="spec_ext-draft")
            worker.start()
            return link, worker
        key = (self.policy.draft_rank, None)
        if key not in _TARGET_LINKS:  # one receiver thread per peer for the life of the process
            _TARGET_LINKS[key] = _DistributedLink(self.policy.draft_rank, self.policy.timeout, "draft")
        link = _TARGET_LINKS[key]
        link.timeout = self.policy.timeout
        return link, None

    def _run(self, link):
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=self.generator))
        link.send(_Start(self.prompts, self.sampler.temperature, self.sampler.top_k, self.sampler.top_p, seed,
                         self.capacity, self.policy.lookahead))
        while not isinstance(hello := link.get(), _Hello):
            pass  # leftovers of an earlier call that failed on this side
        if hello.vocab_size != self.target.config.vocab_size:
            raise ValueError(f"draft: vocabulary size {hello.vocab_size} differs from the target's "
                             f"{self.target.config.vocab_size}")
        self._prefill()
        while self.active:
            self._round(link)
        link.send(_End())
        while not isinstance(message := link.get(), _Done):
            pass
        self.stats.draft_calls = message.draft_calls
        self.policy.chosen_gamma = self._gamma()
        self.stats.new_tokens = sum(map(len, self.new))
        return self.stats

    def _prefill(self) -> None:
        heads = [s[:-1] for s in self.seqs]
        if max(map(len, heads)) == 0:
            return
        ids = torch.tensor([h + [0] * (max(map(len, heads)) - len(h)) for h in heads], device=self.device)
        self.stats.target_calls += 1
        hf.forward(self.target, ids, self.cache, torch.arange(ids.shape[1], device=self.device).expand_as(ids))
        self.cache.advance([len(h) for h in heads])

    def _round(self, link) -> None:
        rows, gamma = self.active, self._gamma()
        self._receive(link, lambda: all(self.queues[r] for r in rows))
        fed = [min(len(self.queues[r]) - 1, gamma) for r in rows]
        width = max(fed)
        ids = torch.tensor([[self.seqs[r][-1]] + [t for t, _ in self.queues[r][:k]] + [0] * (width - k)
                            for r, k in zip(rows, fed)], device=self.device)
        positions = self.cache.lengths[:, None] + torch.arange(width + 1, device=self.device)
        started = time.perf_counter()
        self.stats.target_calls += 1
        logits = hf.forward(self.target, ids, self.cache, positions)
        logits = torch.cat([logits, logits[:, -1:]], 1)  # a placeholder bonus row: all-accepted samples nothing
        self.forward_seconds.append(time.perf_counter() - started)
        self._receive(link, lambda: all(len(self.queues[r]) > k for r, k in zip(rows, fed)))
        num_draft = [k + 1 for k in fed]
        drafts = torch.tensor([[t for t, _ in self.queues[r][:n]] + [-1] * (width + 1 - n)
                               for r, n in zip(rows, num_draft)], device=self.device)
        num_draft_t = torch.tensor(num_draft, device=self.device)
        if self.sampler.greedy:
            result = ops.greedy_verify(logits, drafts, num_draft_t)
        else:
            V = logits.shape[-1]
            q = torch.zeros(len(rows), width + 1, V, device=self.device)
            for i, (r, n) in enumerate(zip(rows, num_draft)):
                q[i, :n] = torch.stack([dist for _, dist in self.queues[r][:n]])
            result = ops.chain_rejection_sample(self.sampler.probs(logits), drafts, q, num_draft_t,
                                                generator=self.generator)
        tokens, accepted = result.tokens.tolist(), result.num_accepted.tolist()
        self.cache.advance([min(a, k) + 1 for a, k in zip(accepted, fed)])
        verdict, keep = _Verdict(committed={}), []
        for i, r in enumerate(rows):
            a, n = accepted[i], num_draft[i]
            emitted = tokens[i][:a] if a == n else tokens[i][:a + 1]
            if a == n:
                del self.queues[r][:n]
            else:
                self.queues[r].clear()
                self.epochs[r] += 1
            emitted = emitted[:self.max_new - len(self.new[r])]
            for j, tok in enumerate(emitted):
                if tok in self.eos:
                    emitted = emitted[:j + 1]
                    break
            self.seqs[r] += emitted
            self.new[r] += emitted
            self.stats.rounds += 1
            self.stats.drafted += n
            self.stats.accepted += a
            self.stats.accepted_lengths.append(a)
            self.stats.draft_lengths.append(n)
            if self.streamer is not None:
                self.streamer.put(torch.tensor(emitted))
            if len(self.new[r]) < self.max_new and not (emitted and emitted[-1] in self.eos):
                keep.append(i)
                verdict.committed[r] = len(self.seqs[r])
                if a < n:
                    verdict.resets[r] = (self.epochs[r], self.seqs[r][-1])
            else:
                verdict.finished.append(r)
                del self.queues[r]
        if len(keep) < len(rows):
            self.cache.keep_rows(keep)
            self.active = [rows[i] for i in keep]
        link.send(verdict)


# ------------------------------------------------------------------ draft side
def serve_draft(draft, target_rank: int = 0, timeout: float = 600.0, group=None) -> None:
    """Run the draft side of ``PEARL(mode="distributed")`` generate calls made on
    ``target_rank`` until that rank calls :func:`shutdown` (or dies: then PeerError).

    Example (one script, ``torchrun --nproc-per-node 2 script.py``):
        >>> dist.init_process_group("gloo")                                   # doctest: +SKIP
        >>> if dist.get_rank() == 1:                                          # doctest: +SKIP
        ...     spec_ext.parallel.serve_draft(draft)
        ... else:
        ...     out = spec_ext.generate(target, None, ids, policy=PEARL(mode="distributed"))
        ...     spec_ext.parallel.shutdown()
    """
    link = _DistributedLink(target_rank, timeout, "target", (_Shutdown,), group)
    while True:
        if _serve_one(draft, link, raise_errors=True) == "shutdown":
            return


def shutdown(draft_rank: int = 1, group=None) -> None:
    """Tell the draft rank's :func:`serve_draft` to return."""
    import torch.distributed as dist
    payload = pickle.dumps(_Shutdown())
    dist.send(torch.tensor([len(payload)]), draft_rank, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), draft_rank, group=group)


_TARGET_LINKS: dict = {}


def _serve_one(draft, link, raise_errors: bool = False, threads: int | None = None):
    """One generate call's draft side; failures go to the target side (and are raised
    when ``raise_errors``)."""
    if threads is not None:
        torch.set_num_threads(threads)  # per calling thread for the OpenMP backend
    try:
        return _DraftSide(draft, link).run()
    except BaseException as error:  # noqa: BLE001 - the target side must learn of any failure
        try:
            link.send(_Failure(f"{type(error).__name__}: {error}"))
        except Exception:  # noqa: BLE001 - the link itself may be what failed
            pass
        if raise_errors:
            raise


class _DraftSide:
    def __init__(self, draft, link):
        self.draft, self.link = draft, link
        self.calls = 0

    def run(self):
        start = self.link.get()
        if isinstance(start, _Shutdown):
            return "shutdown"
        if not isinstance(start, _Start):
            raise PeerError(f"expected a start message, got {type(start).__name__}")
        from spec_ext.decoding import Sampler
        self.link.send(_Hello(self.draft.config.vocab_size))
        sampler = Sampler(start.temperature, start.top_k, start.top_p)
        generator = torch.Generator(device=self.draft.device).manual_seed(start.seed)
        device = self.draft.device
        rows = list(range(len(start.prompts)))
        epochs = [0] * len(rows)
        committed = [len(p) for p in start.prompts]
        next_token = [p[-1] for p in start.prompts]
        cache = SpecCache.for_model(self.draft, len(rows), start.capacity)
        with hf.attention_implementation(self.draft), torch.inference_mode():
            heads = [p[:-1] for p in start.prompts]
            if max(map(len, heads)) > 0:
                ids = torch.tensor([h + [0] * (max(map(len, heads)) - len(h)) for h in heads], device=device)
                self.calls += 1
                hf.forward(self.draft, ids, cache, torch.arange(ids.shape[1], device=device).expand_as(ids))
                cache.advance([len(h) for h in heads])
            while True:
                lengths = cache.host_lengths
                go = [lengths[i] + 1 - committed[i] < start.lookahead for i in range(len(rows))]
                messages = self.link.poll() if any(go) else [self.link.get()]
                for message in messages:
                    if isinstance(message, _End):
                        self.link.send(_Done(self.calls))
                        return "done"
                    if not isinstance(message, _Verdict):
                        raise PeerError(f"unexpected message from the target side: {type(message).__name__}")
                    index = {r: i for i, r in enumerate(rows)}
                    keep_lengths = list(cache.host_lengths)
                    for r, length in message.committed.items():
                        committed[index[r]] = length
                    for r, (epoch, token) in message.resets.items():
                        i = index[r]
                        epochs[i], next_token[i] = epoch, token
                        keep_lengths[i] = message.committed[r] - 1
                    cache.rollback(keep_lengths)
                    if message.finished:
                        keep = [i for i, r in enumerate(rows) if r not in set(message.finished)]
                        if not keep:
                            continue
                        cache.keep_rows(keep)
                        rows, epochs, committed, next_token = ([x[i] for i in keep]
                                                              for x in (rows, epochs, committed, next_token))
                if messages:
                    continue  # re-plan with the new state (or wait again)
                started = time.perf_counter()
                ids = torch.tensor(next_token, device=device)[:, None]
                self.calls += 1
                logits = hf.forward(self.draft, ids, cache, cache.lengths[:, None])[:, 0]
                if sampler.greedy:
                    tokens, q = logits.argmax(-1), None
                else:
                    q = sampler.probs(logits)
                    tokens = torch.multinomial(q, 1, generator=generator)[:, 0]
                cache.advance([int(g) for g in go])
                chosen = [i for i, g in enumerate(go) if g]
                token_list = tokens.tolist()
                self.link.send(_Drafts([rows[i] for i in chosen], [epochs[i] for i in chosen],
                                       [token_list[i] for i in chosen], None if q is None else q[chosen],
                                       time.perf_counter() - started))
                for i in chosen:
                    next_token[i] = token_list[i]


def split_threads() -> tuple[int, int]:
    """(target, draft) intra-op threads for the threads mode: the cores split in half."""
    cores = os.cpu_count() or 2
    return max(1, cores - cores // 2), max(1, cores // 2)
