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

Modules: :mod:`.messages` (what the sides send), :mod:`.links` (threads or
torch.distributed), :mod:`.target_side` (:class:`ParallelEngine`), :mod:`.draft_side`.

Modes: ``threads`` runs the draft side in a thread of this process (on CPU the cores
split between the two: torch intra-op threads are set to half each; on a GPU the draft
thread runs on its own CUDA stream); ``distributed`` runs it
in another process of a torch.distributed group (gloo on CPU), rank ``draft_rank``
running :func:`serve_draft`. If the other side dies or stalls, the waiting side raises
:class:`PeerError` within ``timeout`` seconds and no output is returned.
"""
from spec_ext.engine.parallel.draft_side import serve_draft, shutdown, split_threads
from spec_ext.engine.parallel.messages import PeerError
from spec_ext.engine.parallel.target_side import ParallelEngine

__all__ = ["ParallelEngine", "PeerError", "serve_draft", "shutdown", "split_threads"]
