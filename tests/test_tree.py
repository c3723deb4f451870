import pytest
import torch

import spec_ext
from spec_ext import reference
from helpers import backend_params, device_for, random_parents


def chain(T):
    return torch.arange(-1, T - 1).unsqueeze(0)


def star(T):
    return torch.tensor([[-1] + [0] * (T - 1)])


@pytest.mark.parametrize("backend", backend_params("tree_mask"))
@pytest.mark.parametrize("make", ["random", "chain", "star"])
@pytest.mark.parametrize("T", [1, 2, 31, 32, 33, 64, 70])
def test_tree_mask_matches_reference(backend, make, T):
    g = torch.Generator().manual_seed(T)
    parents = {"random": lambda: random_parents(3, T, g), "chain": lambda: chain(T), "star": lambda: star(T)}[make]()
    depth, mask = spec_ext.tree_mask(parents.to(device_for(backend)), backend=backend)
    ref_depth, ref_mask = reference.tree_mask(parents)
    assert torch.equal(depth.cpu(), ref_depth)
    assert torch.equal(mask.cpu(), ref_mask)


def test_reference_mask_is_ancestor_relation():
    g = torch.Generator().manual_seed(0)
    parents = random_parents(2, 40, g)
    depth, mask = reference.tree_mask(parents)
    bits = reference.unpack_mask(mask, 40)
    for b in range(2):
        for i in range(40):
            ancestors, node = {i}, i
            while parents[b, node] >= 0:
                node = int(parents[b, node])
                ancestors.add(node)
            assert set(torch.nonzero(bits[b, i]).flatten().tolist()) == ancestors
            assert depth[b, i] == len(ancestors) - 1


def test_build_tree_children_and_paths():
    tree = spec_ext.build_tree([-1, 0, 0, 1, 1, 2])
    assert tree.children[0] == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.paths[0] == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert tree.max_depth == 2
    assert tree.positions(torch.tensor([10])).tolist() == [[10, 11, 11, 12, 12, 12]]


@pytest.mark.parametrize("parents, message", [
    ([0, 0], "root"),
    ([-1, 1], "0 <= parent < i"),
    ([-1, 0, -1], "0 <= parent < i"),
    ([], "at least its root"),
])
def test_malformed_trees_raise(parents, message):
    with pytest.raises(ValueError, match=message):
        spec_ext.build_tree(torch.tensor(parents, dtype=torch.int64))


def test_parents_dtype_is_checked():
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        spec_ext.tree_mask(torch.tensor([-1, 0], dtype=torch.int32))
