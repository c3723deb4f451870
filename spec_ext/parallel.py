"""Parallel speculative decoding: the draft never waits for the target (PEARL), and
branches where it is unsure (SpecBranch).

Two sides run at once and talk only through messages:
  * the draft side drafts one token per lane per step, ahead of what is committed (up to
    a lookahead), and sends each new node (row, id, parent id, token, and the q it was
    drawn from). A row has one lane (PEARL) or up to ``branches`` (SpecBranch): where the
    draft's probability of its token is q, it forks k = max(1, floor(branches * (1 - q)))
    siblings (top-k when greedy, drawn without replacement from q when sampling), each a
    lane that copies its parent's cache row and drafts on;
  * the target side owns every decision and all verification randomness. Each round it
    feeds the root and up to ``gamma`` queued nodes that already have a child, with tree
    attention, then verifies those nodes and their children with (multi-draft recursive)
    rejection sampling: a draft that arrived during the forward is checked by its
    parent's distribution at once (PEARL's pre-verify) while drafting went on meanwhile
    (post-verify). If the accepted path ends on an unfed draft, nothing is sampled: that
    draft is the next root and the lanes through it carry on undisturbed; otherwise the
    corrected token is the next root and the row's draft restarts from it.
Each draft is tested exactly once, against the target distribution of its own prefix, with
fresh uniforms (siblings as draws without replacement), so greedy output equals the
target's and sampled output follows the target's distribution whatever the timing
(PEARL's published code reuses one uniform for two tests; SpecBranch's drafts top-k
branches against a temperature-1 q: neither is exact when sampling).

Modes: ``threads`` runs the draft side in a thread of this process (on CPU the cores
split between the two: torch intra-op threads are set to half each; on a GPU the draft
thread runs on its own CUDA stream); ``distributed`` runs it
in another process of a torch.distributed group (gloo on CPU), rank ``draft_rank``
running :func:`serve_draft`. If the other side dies or stalls, the waiting side raises
:class:`PeerError` within ``timeout`` seconds and no output is returned.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spec_ext import hf, ops
from spec_ext.cache import SpecCache
from spec_ext.decoding import Sampler, Stats, _Rows, check_finite
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
    branches: int         # most lanes (branches) per row; 1 = a chain (PEARL)
    fast_linear: bool | str  # the draft's linear layers take ops.skinny_linear (lean.prepare)


@dataclass
class _Hello:
    vocab_size: int


@dataclass
class _Drafts:
    """One draft step: node ``nodes[i]`` of row ``rows[i]`` holds ``tokens[i]``, a child of
    node ``parents[i]`` (-1: the row's current root), drawn from ``q[i]`` (sampling)."""
    rows: list[int]
    epochs: list[int]
    nodes: list[int]
    parents: list[int]
    tokens: list[int]
    q: Tensor | None
    seconds: float        # the draft step's wall time


@dataclass
class _Verdict:
    committed: dict[int, int]                                     # row -> committed length
    moves: dict[int, int] = field(default_factory=dict)           # row -> accepted node that is the new root
    resets: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # row -> (epoch, last accepted node, token)
    finished: list[int] = field(default_factory=list)
    hints: dict[int, int] = field(default_factory=dict)           # row -> branch hint (REJECT_ALL, ...)


REJECT_ALL, DEFER, ACCEPT_ALL = 0, 1, 2  # branch-point predictor classes for the next drafts
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

    def get(self, wait_forever: bool = False):
        """The next message; PeerError after ``timeout`` seconds of silence (unless
        ``wait_forever``: a dead peer still raises, through the receiver)."""
        try:
            return self._check(self.inbox.get(timeout=None if wait_forever else self.timeout))
        except queue.Empty:
            raise PeerError(f"the {self.peer} side sent nothing for {self.timeout:g} s: it stalled or died "
                            f"(no output is returned){self.peer_location()}") from None

    def peer_location(self) -> str:
        return ""

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
        self.peer_thread: threading.Thread | None = None

    def peer_location(self) -> str:
        """Where the stalled peer thread is, for the error message."""
        frame = sys._current_frames().get(getattr(self.peer_thread, "ident", None))
        if frame is None:
            return ""
        return "; it was at:\n" + "".join(traceback.format_stack(frame)[-6:])

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


# ------------------------------------------------------------------ the policies
@register
class PEARL(Policy):
    """Parallel speculative decoding (see the module docstring).

    Args:
        gamma: most drafts fed to one target forward; None picks it from the measured
            target-forward / draft-step time ratio.
        mode: ``"threads"`` or ``"distributed"`` (the draft model lives on ``draft_rank``,
            which runs :func:`serve_draft`; pass ``draft=None`` to generate).
        timeout: seconds without a message from the other side before giving up.
        max_gamma: the most drafts per forward that the automatic gamma may pick.
    """

    kind = "parallel"
    branches = 1
    learned = False

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
        """How far (tokens past the committed ones) a lane may draft ahead."""
        return 2 * self.max_draft + 2

    def make_loop(self, target, draft, prompts, max_new_tokens, sampler, eos, generator, streamer,
                  fast_linear: bool = False):
        return _TargetSide(self, target, draft, prompts, max_new_tokens, sampler, eos, generator, streamer,
                           fast_linear)


@register
class SpecBranch(PEARL):
    """PEARL plus branches at uncertain points: when the draft's probability of the token
    it drew is q, it forks k = max(1, floor(branches * (1 - q))) siblings there (top-k when
    greedy, drawn without replacement from the draft distribution when sampling), each
    drafted on as its own lane while lanes are free (at most ``branches`` per row). The
    target verifies the whole tree in one forward with tree attention and multi-draft
    recursive rejection sampling, so the branch decisions keep the output exact.
    ``predictor``: a :class:`spec_ext.learned.BranchPredictor` that reads the target's
    hidden state after each verification and tells the draft side where to branch (SpecBranch's
    learned branch points); None branches by the draft's confidence only.
    Other arguments as :class:`PEARL`.
    """

    def __init__(self, branches: int = 4, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12, predictor=None):
        super().__init__(gamma, mode, draft_rank, timeout, max_gamma)
        if branches < 1:
            raise ValueError(f"branches: must be >= 1, got {branches}")
        self.branches = branches
        self._predictor = predictor
        self.learned = predictor is not None

    def bind(self, target, draft) -> None:
        if self._predictor is not None:
            self._predictor.bind(target)

    def hints(self, hidden: Tensor, roots: Tensor, greedy: bool) -> list[int]:
        """Per row: REJECT_ALL (fork all branches at the root's first draft), ACCEPT_ALL
        (draft a plain chain) or DEFER (fork by the draft's confidence)."""
        if self._predictor is None:
            return [DEFER] * len(roots)
        return self._predictor.classify(hidden, roots, greedy)


# ------------------------------------------------------------------ target side
class _TargetSide(_Rows):
    """Owns the target, every decision and all verification randomness. Per row it keeps
    the draft tree received so far: node id -> (parent id, token, q it was drawn from)."""

    def __init__(self, policy: PEARL, target, draft, prompts, max_new, sampler, eos, generator, streamer,
                 fast_linear: bool = False):
        self.policy, self.target, self.draft = policy, target, draft
        self.fast_linear = fast_linear
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
        self.trees: dict[int, dict[int, tuple[int, int, Tensor | None]]] = {r: {} for r in self.active}
        self.epochs = {r: 0 for r in self.active}
        self.root_node = {r: -1 for r in self.active}  # the draft node id of each row's root (-1: none)
        self.forward_seconds: list[float] = []
        self.draft_seconds: list[float] = []

    def _gamma(self) -> int:
        if self.policy.gamma is not None:
            return self.policy.gamma
        if len(self.forward_seconds) < 2 or not self.draft_seconds:
            return 2
        ratio = statistics.median(self.forward_seconds[-16:]) / statistics.median(self.draft_seconds[-64:])
        return max(1, min(self.policy.max_draft, round(ratio)))

    def _take(self, message) -> None:
        if isinstance(message, _Drafts):
            self.draft_seconds.append(message.seconds)
            if message.q is not None and message.q.is_cuda:  # made on the draft thread's stream
                message.q.record_stream(torch.cuda.current_stream(message.q.device))
            for i, (row, epoch) in enumerate(zip(message.rows, message.epochs)):
                parent = message.parents[i]
                if row in self.trees and parent == self.root_node[row]:
                    parent = -1
                if row in self.trees and epoch == self.epochs[row] and (parent == -1 or parent in self.trees[row]):
                    q = None if message.q is None else message.q[i]
                    self.trees[row][message.nodes[i]] = (parent, message.tokens[i], q)
                else:  # stale: drafted before the draft side heard of a rejection or a pruned branch
                    self.stats.discarded += 1
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
            link.peer_thread = worker
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
                         self.capacity, self.policy.lookahead, self.policy.branches, self.fast_linear or "auto"))
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
        logits = hf.forward(self.target, ids, self.cache, torch.arange(ids.shape[1], device=self.device).expand_as(ids))
        check_finite(logits, "target")
        self.cache.advance([len(h) for h in heads])

    def _plan(self, tree: dict, gamma: int) -> tuple[dict[int, int], list[int]]:
        """(fed, checked): the forward position of the root (-1 -> 0) and of every node fed
        to the forward (the first ``gamma`` nodes that have a child, in id order: closed
        under parents), and every node verified this round (the fed ones' and the root's
        children, plus the fed ones), in id order."""
        parents_with_children = {parent for parent, _, _ in tree.values()}
        fed = {-1: 0} | {n: j + 1 for j, n in enumerate([n for n in sorted(tree) if n in parents_with_children]
                                                         [:gamma])}
        checked = [n for n in sorted(tree) if n in fed or tree[n][0] in fed]
        return fed, checked

    def _round(self, link) -> None:
        rows, gamma = self.active, self._gamma()
        for message in link.poll():
            self._take(message)
        while not all(any(parent == -1 for parent, _, _ in self.trees[r].values()) for r in rows):
            self._take(link.get())
        plans = [self._plan(self.trees[r], gamma) for r in rows]
        width = max(len(fed) for fed, _ in plans)
        size = 1 + max(len(checked) for _, checked in plans)
        # forward: root + fed nodes (index 0 is the root); padding hangs off the root
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        forward_parents = torch.zeros(len(rows), width, dtype=torch.int64)
        forward_parents[:, 0] = -1
        # verification tree: root + checked nodes; padding is absent (-1 tokens)
        tokens_v = torch.full((len(rows), size), -1, dtype=torch.int64)
        parents_v = torch.zeros(len(rows), size, dtype=torch.int64)
        parents_v[:, 0] = -1
        source = torch.zeros(len(rows), size, dtype=torch.int64)  # forward index whose p node i uses
        for i, (r, (fed, checked)) in enumerate(zip(rows, plans)):
            tree = self.trees[r]
            ids[i, 0] = tokens_v[i, 0] = self.seqs[r][-1]
            for n, j in fed.items():
                if n != -1:
                    ids[i, j] = tree[n][1]
                    forward_parents[i, j] = fed[tree[n][0]]
            check_index = {-1: 0} | {n: j + 1 for j, n in enumerate(checked)}
            for j, n in enumerate(checked):
                parent, token, _ = tree[n]
                tokens_v[i, j + 1], parents_v[i, j + 1] = token, check_index[parent]
                # an unfed node is a leaf here: its p only feeds a bonus draw that is never used
                source[i, j + 1] = fed.get(n, fed[parent])
        depth, tree_mask = ops.tree_mask(forward_parents.to(self.device), validate=False)
        positions = self.cache.lengths[:, None] + depth
        started = time.perf_counter()
        self.stats.target_calls += 1
        out = hf.forward(self.target, ids.to(self.device), self.cache, positions, tree_mask,
                         hidden=self.policy.learned)
        logits, hidden = out if self.policy.learned else (out, None)
        self.forward_seconds.append(time.perf_counter() - started)
        logits = logits.gather(1, source.to(self.device)[..., None].expand(-1, -1, logits.shape[-1]))
        tokens_v, parents_v = tokens_v.to(self.device), parents_v.to(self.device)
        if self.sampler.greedy:
            result = ops.tree_greedy_verify(logits, tokens_v, parents_v, validate=False)  # inputs built here
        else:
            q = torch.zeros(len(rows), size, logits.shape[-1], device=self.device)
            for i, (r, (_, checked)) in enumerate(zip(rows, plans)):
                for j, n in enumerate(checked):  # q of a node's children sits on the node (index of its parent)
                    parent = int(parents_v[i, j + 1])
                    q[i, parent] = self.trees[r][n][2]
            result = ops.tree_rejection_sample(self.sampler.probs(logits), tokens_v, parents_v, q,
                                               siblings="without_replacement", generator=self.generator,
                                               validate=False)
        self._settle(link, rows, plans, result, hidden)

    def _settle(self, link, rows, plans, result, hidden) -> None:
        """Emit the accepted tokens, commit the target cache, tell the draft side."""
        paths, tokens, accepted = result.path.tolist(), result.tokens.tolist(), result.num_accepted.tolist()
        commit_paths, commit_counts = [], []
        verdict, keep = _Verdict(committed={}), []
        for i, r in enumerate(rows):
            fed, checked = plans[i]
            tree, a = self.trees[r], accepted[i]
            path_nodes = [-1] + [checked[j - 1] for j in paths[i][1:a + 1]]
            last = path_nodes[-1]
            moved = last not in fed  # ended on an unfed draft: it becomes the root
            emitted = tokens[i][:a] if moved else tokens[i][:a + 1]
            kept_in_cache = path_nodes[:-1] if moved else path_nodes
            commit_paths.append([fed[n] for n in kept_in_cache])
            commit_counts.append(len(kept_in_cache) - 1)
            before = len(tree)
            if moved:
                subtree = {last}
                for n in sorted(tree):
                    if tree[n][0] in subtree:
                        subtree.add(n)
                self.trees[r] = {n: ((-1 if p == last else p), t, q) for n, (p, t, q) in tree.items()
                                 if n in subtree and n != last}
                self.root_node[r] = last
            else:
                self.trees[r] = {}
                self.epochs[r] += 1
                self.root_node[r] = -1
            self.stats.discarded += before - len(self.trees[r]) - len(checked)
            if self._emit(r, emitted, len(checked), a):
                keep.append(i)
                verdict.committed[r] = len(self.seqs[r])
                if moved:
                    verdict.moves[r] = last
                else:
                    verdict.resets[r] = (self.epochs[r], last, self.seqs[r][-1])
            else:
                verdict.finished.append(r)
                del self.trees[r]
        if hidden is not None and keep:  # the state that produced each row's new root
            index = torch.tensor([commit_paths[i][-1] for i in keep], device=self.device)
            roots = torch.tensor([self.seqs[rows[i]][-1] for i in keep], device=self.device)
            hints = self.policy.hints(hidden[torch.tensor(keep, device=self.device), index], roots,
                                      self.sampler.greedy)
            verdict.hints = {rows[i]: h for i, h in zip(keep, hints)}
        width = max(map(len, commit_paths))
        self.cache.commit(torch.tensor([p + [-1] * (width - len(p)) for p in commit_paths]), commit_counts)
        if len(keep) < len(rows):
            self.cache.keep_rows(keep)
            self.active = [rows[i] for i in keep]
        link.send(verdict)


# ------------------------------------------------------------------ draft side
def serve_draft(draft, target_rank: int = 0, timeout: float = 600.0, group=None) -> None:
    """Run the draft side of ``PEARL(mode="distributed")`` (or ``SpecBranch``) generate
    calls made on ``target_rank`` until that rank calls :func:`shutdown` (or dies: then
    PeerError). Between calls it waits as long as it takes; within a call, ``timeout``
    seconds of silence from the target rank raise PeerError.

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
    # in one process on a GPU the draft runs on its own CUDA stream, so its kernels overlap the target's
    stream = torch.cuda.Stream(draft.device) if threads is not None and draft.device.type == "cuda" else None
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return _DraftSide(draft, link, stream).run()
    except BaseException as error:  # noqa: BLE001 - the target side must learn of any failure
        try:
            link.send(_Failure(f"{type(error).__name__}: {error}"))
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


class _DraftSide:
    """Drafts every lane of every row one token per step; lane ``slot``s are rows of one
    SpecCache, ``branches`` per batch row."""

    def __init__(self, draft, link, stream=None):
        self.draft, self.link, self.stream = draft, link, stream
        self.calls = 0

    def run(self):
        start = self.link.get(wait_forever=True)  # a serving rank may idle between generate calls
        if isinstance(start, _Shutdown):
            return "shutdown"
        if not isinstance(start, _Start):
            raise PeerError(f"expected a start message, got {type(start).__name__}")
        self.link.send(_Hello(self.draft.config.vocab_size))
        self.start, self.device = start, self.draft.device
        self.sampler = Sampler(start.temperature, start.top_k, start.top_p)
        self.generator = torch.Generator(device=self.device).manual_seed(start.seed)
        B, k = len(start.prompts), start.branches
        self.cache = SpecCache.for_model(self.draft, B * k, start.capacity)
        self.lanes = {r: [_Lane(r * k, p[-1], set(), -1)] for r, p in enumerate(start.prompts)}
        self.free = {r: list(range(r * k + 1, (r + 1) * k)) for r in range(B)}
        self.epochs, self.next_node = [0] * B, [0] * B
        self.roots, self.hints = [-1] * B, [DEFER] * B  # each row's root node id, branch hint
        self.committed = [len(p) for p in start.prompts]
        with hf.attention_implementation(self.draft, fast_linear=start.fast_linear), torch.inference_mode():
            self._prefill()
            while True:
                live = [lane for r, lanes in self.lanes.items() for lane in lanes
                        if self.cache.host_lengths[lane.slot] + 1 - self.committed[r] < start.lookahead]
                messages = self.link.poll() if live else [self.link.get()]
                for message in messages:
                    if isinstance(message, _End):
                        self.link.send(_Done(self.calls))
                        return "done"
                    if not isinstance(message, _Verdict):
                        raise PeerError(f"unexpected message from the target side: {type(message).__name__}")
                    self._apply(message)
                if not messages:
                    self._step(live)

    def _prefill(self) -> None:
        heads = [p[:-1] for p in self.start.prompts]
        if max(map(len, heads)) == 0:
            return
        k = self.start.branches
        rows = [heads[slot // k] if slot % k == 0 else [] for slot in range(len(heads) * k)]
        width = max(map(len, rows))
        ids = torch.tensor([h + [0] * (width - len(h)) for h in rows], device=self.device)
        self.calls += 1
        logits = hf.forward(self.draft, ids, self.cache, torch.arange(width, device=self.device).expand_as(ids))
        check_finite(logits, "draft")
        self.cache.advance([len(h) for h in rows])

    def _apply(self, verdict: _Verdict) -> None:
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
        self.calls += 1
        logits = hf.forward(self.draft, ids.to(self.device), self.cache, self.cache.lengths[:, None])[:, 0]
        advance = [0] * slots
        for lane in live:
            advance[lane.slot] = 1
        self.cache.advance(advance)
        index = torch.tensor([lane.slot for lane in live], device=self.device)
        logits = logits[index]
        confidence_probs = torch.softmax(logits, -1)
        if self.sampler.greedy:
            q, first = None, logits.argmax(-1)
        else:
            q = self.sampler.probs(logits)
            first = torch.multinomial(q, 1, generator=self.generator)[:, 0]
        confidence = confidence_probs.gather(1, first[:, None])[:, 0].tolist()
        first = first.tolist()
        owner = {lane.slot: r for r, lanes in self.lanes.items() for lane in lanes}
        rows, nodes, parents, tokens, sources = [], [], [], [], []
        copies = []
        for i, lane in enumerate(live):
            r = owner[lane.slot]
            if self.hints[r] == ACCEPT_ALL:
                count = 1
            elif self.hints[r] == REJECT_ALL and lane.last == self.roots[r]:
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
        self.link.send(_Drafts(rows, [self.epochs[r] for r in rows], nodes, parents, tokens, q_sent,
                               time.perf_counter() - started))


def split_threads() -> tuple[int, int]:
    """(target, draft) intra-op threads for the threads mode: the cores split in half."""
    cores = os.cpu_count() or 2
    return max(1, cores - cores // 2), max(1, cores // 2)
