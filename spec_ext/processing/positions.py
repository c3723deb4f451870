"""Which prefix each processed position continues: a row's committed tokens, then a path of
drafts (none for the position right after the committed tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Positions:
    """B rows x T positions whose logits are processed in one call: position (b, t)
    continues row b's committed tokens with ``path[b, t, D - depth[b, t]:]``.

    ``path`` [B,T,D] int64, right-aligned (the position's last path token at ``D - 1``), -1
    before the path; ``depth`` [B,T] int64 its length; ``parents`` [B,T] int64 the position
    whose distribution the last path token was drawn from (-1: none in this call);
    ``valid`` [B,T] bool: the positions whose logits may be used (not past a row's drafts,
    not an absent tree node); the others are left as they are and never reach user code.
    """
    path: Tensor
    depth: Tensor
    parents: Tensor
    valid: Tensor

    @staticmethod
    def after(drafts: Tensor) -> "Positions":
        """One position per row, after the drafts [B,n] so far (a draft step of a chain; a row
        that stopped drafting, -1 among its drafts, is not valid)."""
        B, n = drafts.shape
        device = drafts.device
        return Positions(drafts[:, None, :], torch.full((B, 1), n, dtype=torch.int64, device=device),
                         torch.full((B, 1), -1, dtype=torch.int64, device=device), (drafts >= 0).all(1)[:, None])

    @staticmethod
    def chain(drafts: Tensor, num_draft: Tensor) -> "Positions":
        """The K + 1 positions that verify a chain: position j after ``drafts[b, :j]`` (drafts
        [B,K], -1 padded; num_draft [B]); positions past a row's drafts are not valid."""
        B, K = drafts.shape
        steps = torch.arange(K + 1, device=drafts.device)
        source = torch.arange(K, device=drafts.device)[None, :] - K + steps[:, None]  # [K+1, K]
        path = drafts[:, source.clamp_min(0)].masked_fill(source < 0, -1)
        return Positions(path, steps.expand(B, K + 1), (steps - 1).expand(B, K + 1),
                         steps[None, :] <= num_draft[:, None])

    @staticmethod
    def tree(tokens: Tensor, parents: Tensor, depth: Tensor, max_depth: int) -> "Positions":
        """Every node of a tree (tokens [B,T] with node 0 the root, -1 for absent nodes;
        parents and depth [T] or [B,T]): a node's path is its ancestors' tokens below the
        root, then its own."""
        B, T = tokens.shape
        parents, depth = parents.expand(B, T), depth.expand(B, T)
        path = torch.full((B, T, max_depth), -1, dtype=torch.int64, device=tokens.device)
        node = torch.arange(T, device=tokens.device).expand(B, T)
        for s in range(max_depth):  # s steps up from the node
            path[:, :, max_depth - 1 - s] = torch.where(s < depth, tokens.gather(1, node), -1)
            node = parents.gather(1, node).clamp_min(0)
        valid = tokens >= 0
        valid[:, 0] = True
        return Positions(path, depth, parents, valid)

    def reachable(self, scores: Tensor) -> Tensor:
        """[B,T] bool: valid positions whose every path token in this call was allowed (a
        finite score) at its parent in ``scores`` [B,T,V]: the verification can only reach
        these (a draft the processed distribution bans is never accepted). With no path
        column (a round that verifies the roots alone, e.g. adaptive verification cut every
        row to none of its drafts) no position has a parent here: the valid ones."""
        if self.path.shape[-1] == 0:
            return self.valid.clone()
        has_parent = self.parents >= 0
        parent = self.parents.clamp_min(0)
        token = self.path[..., -1].clamp_min(0)
        rows = torch.arange(len(scores), device=scores.device)[:, None]
        allowed = torch.isfinite(scores[rows, parent, token.clamp_max(scores.shape[-1] - 1)]) & \
            (self.path[..., -1] < scores.shape[-1])
        reached = self.valid & (allowed | ~has_parent)
        for _ in range(self.path.shape[-1]):
            reached = reached & (reached.gather(1, parent) | ~has_parent)
        return reached
