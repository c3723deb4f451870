"""The target side of a parallel run (see :mod:`spec_ext.engine.parallel`)."""
from __future__ import annotations

import queue
import statistics
import threading
import time

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.drafters import check_finite, pad_rows
from spec_ext.engine.common import Rows, lead_in
from spec_ext.engine.parallel.draft_side import serve_one, split_threads
from spec_ext.engine.parallel.links import DistributedLink, ThreadLink
from spec_ext.engine.parallel.messages import Done, Drafts, End, Hello, PeerError, Start, Verdict
from spec_ext.models import SpecCache, forward, vocabulary_size
from spec_ext.policies import PEARL

_TARGET_LINKS: dict = {}  # (draft rank, group) -> DistributedLink: one receiver thread per peer per process


class ParallelEngine(Rows):
    """The target side: owns the target, every decision and all verification randomness.
    Per row it keeps the draft tree received so far: node id -> (parent id, token, q it was
    drawn from)."""

    def __init__(self, policy: PEARL, target, draft, prompts, max_new, sampler, eos, generator, streamer,
                 fast_linear: bool = False):
        super().__init__(prompts, max_new, eos, streamer)
        self.policy, self.target, self.draft = policy, target, draft
        self.fast_linear = fast_linear
        self.sampler, self.generator = sampler, generator
        self.device = target.device
        self.prompts = prompts
        self.capacity = max(map(len, prompts)) + max_new + policy.lookahead + 2
        self.cache = SpecCache.for_model(target, len(prompts), self.capacity)
        self.trees: dict[int, dict[int, tuple[int, int, Tensor | None]]] = {r: {} for r in self.active}
        self.epochs = {r: 0 for r in self.active}
        self.root_node = {r: -1 for r in self.active}  # the draft node id of each row's root (-1: none)
        self.forward_seconds: list[float] = []
        self.draft_seconds: list[float] = []
        self.hints = policy.hinter(target)  # (hidden, roots, greedy) -> where each row branches next

    def _gamma(self) -> int:
        if self.policy.gamma is not None:
            return self.policy.gamma
        if len(self.forward_seconds) < 2 or not self.draft_seconds:
            return 2
        ratio = statistics.median(self.forward_seconds[-16:]) / statistics.median(self.draft_seconds[-64:])
        return max(1, min(self.policy.max_draft, round(ratio)))

    def _take(self, message) -> None:
        if isinstance(message, Drafts):
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
        elif isinstance(message, Done):
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
                link.send(End())  # let a live draft side finish this call
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
            link = ThreadLink(to_target, to_draft, self.policy.timeout, "draft")
            draft_link = ThreadLink(to_draft, to_target, self.policy.timeout, "target")
            worker = threading.Thread(target=serve_one, args=(self.draft, draft_link, False, split_threads()[1]),
                                      daemon=True, name="spec_ext-draft")
            link.peer_thread = worker
            worker.start()
            return link, worker
        key = (self.policy.draft_rank, None)
        if key not in _TARGET_LINKS:  # one receiver thread per peer for the life of the process
            _TARGET_LINKS[key] = DistributedLink(self.policy.draft_rank, self.policy.timeout, "draft")
        link = _TARGET_LINKS[key]
        link.timeout = self.policy.timeout
        return link, None

    def _run(self, link):
        device = "cpu" if self.generator is None else self.generator.device  # a CUDA generator draws on CUDA
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=self.generator, device=device))
        link.send(Start(self.prompts, self.sampler.settings, seed,
                         self.capacity, self.policy.lookahead, self.policy.branches, self.fast_linear or "auto",
                         vocabulary_size(self.target)))
        while not isinstance(link.get(), Hello):
            pass  # leftovers of an earlier call that failed on this side
        first = True
        while self.active:
            self._round(link, first)
            first = False
        link.send(End())
        while not isinstance(message := link.get(), Done):
            pass
        self.stats.draft_calls = message.draft_calls
        self.stats.gamma = self._gamma()
        return self.finish()

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

    def _round(self, link, prompt: bool = False) -> None:
        """One verification. ``prompt``: the call's first, whose forward reads every prompt token
        (the cache is empty before it) and checks only the root's children, unfed (their
        subtrees survive when one is kept): the prompt's forward emits the first new token."""
        rows, gamma = self.active, 0 if prompt else self._gamma()
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
        started = time.perf_counter()
        self.stats.target_calls += 1
        if prompt:  # each row's prompt, causal (a long one's head first); the root is its last token
            fed, _, forwards = lead_in(self.target, self.cache, [self.seqs[r] for r in rows])
            self.stats.target_calls += forwards
            prompts = [self.seqs[r][f:] for r, f in zip(rows, fed)]
            ids = pad_rows(prompts, 0, self.device)
            positions = self.cache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
            root = torch.tensor([len(p) - 1 for p in prompts], device=self.device)[:, None]
            logits, hidden, _ = forward(self.target, ids, self.cache, positions, hidden=self.policy.learned,
                                        logits_at=root)  # (the LM head at each root alone)
            check_finite(logits, "target")
            hidden = None if hidden is None else hidden.gather(1, root[..., None].expand(-1, -1, hidden.shape[-1]))
        else:
            depth, tree_mask = ops.tree_mask(forward_parents.to(self.device), validate=False)
            positions = self.cache.lengths[:, None] + depth
            logits, hidden, _ = forward(self.target, ids.to(self.device), self.cache, positions, tree_mask,
                                        hidden=self.policy.learned)
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
        self._settle(link, rows, plans, result, hidden, prompt)

    def _settle(self, link, rows, plans, result, hidden, prompt: bool) -> None:
        """Emit the accepted tokens, commit the target cache (``prompt``: all of each row's
        prompt), tell the draft side."""
        paths, tokens, accepted = result.path.tolist(), result.tokens.tolist(), result.num_accepted.tolist()
        commit_paths, commit_counts = [], []
        verdict, keep = Verdict(committed={}), []
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
            if self.emit(r, emitted, len(checked), a):
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
            hints = self.hints(hidden[torch.tensor(keep, device=self.device), index], roots, self.sampler.greedy)
            verdict.hints = {rows[i]: h for i, h in zip(keep, hints)}
        width = max(map(len, commit_paths))
        if prompt:  # (the root is the only fed node)
            self.cache.advance([len(self.prompts[r]) - n for r, n in zip(rows, self.cache.host_lengths)])
        else:
            self.cache.commit(torch.tensor([p + [-1] * (width - len(p)) for p in commit_paths]), commit_counts)
        if len(keep) < len(rows):
            self.cache.keep_rows(keep)
            self.active = [rows[i] for i in keep]
        link.send(verdict)
