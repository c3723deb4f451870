"""acceptance_head: the CPU kernel against the float64 reference (with a budget relative to
the float32 torch composition SpecDecPP trains with), edge cases of the features, SpecDecPP's
use of it and the argument errors."""
import pytest
import torch

from spec_ext import ops, reference
from spec_ext.policies import Call, ResidualMLP, RoundState, SpecDecPP, draft_features
from spec_ext.policies.learned import LAYER_NORM_EPS

pytestmark = pytest.mark.skipif(not ops.registered("acceptance_head", "CPU"), reason="C++ kernels not built")

SHAPES = [  # B, H, V, D, depth, outputs
    (1, 192, 4096, 64, 1, 2),  # the bundled draft at batch 1
    (8, 192, 4096, 64, 1, 2),
    (3, 7, 5, 9, 0, 1),        # no residual block, odd sizes
    (2, 33, 2, 17, 2, 6),      # two entries per row (top-2 is all of it), two blocks
]


def make(B, H, V, D, depth, outputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = ResidualMLP(H + 3, out_features=outputs, hidden=D, depth=depth)
    with torch.no_grad():  # non-trivial norms and biases, not the initial ones
        for t in head.parameters():
            t.add_(0.3 * torch.randn(t.shape, generator=g))
    probs = torch.softmax(3 * torch.randn(B, V, generator=g), -1)
    return head, torch.randn(B, H, generator=g), probs


def composed(head, hidden, probs, column):
    """What SpecDecPP computes where the kernel does not run (and what it was trained on)."""
    return torch.sigmoid(head(draft_features(hidden, probs))[:, column])


@pytest.mark.parametrize("backend", ["cpu", "torch", "auto"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(backend, shape):
    head, hidden, probs = make(*shape)
    for column in range(shape[-1]):
        exact = reference.acceptance_head(hidden.double(), probs.double(), [t.double() for t in head.weights()],
                                          column, LAYER_NORM_EPS).double()
        got = ops.acceptance_head(hidden, probs, head.weights(), column, backend=backend)
        assert got.shape == (shape[0],) and got.dtype == torch.float32
        with torch.no_grad():
            torch_error = (composed(head, hidden, probs, column).double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 4 * torch_error + 1e-6


def test_zero_probabilities_and_ties():
    head, hidden, _ = make(2, 16, 6, 8, 1, 2)
    probs = torch.tensor([[0.4, 0.4, 0.2, 0.0, 0.0, 0.0],    # tie at the top: margin 0; zeros: no entropy
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])   # one-hot: log max 0, entropy 0, margin 1
    got = ops.acceptance_head(hidden, probs, head.weights(), 1, backend="cpu")
    exact = reference.acceptance_head(hidden, probs, head.weights(), 1, LAYER_NORM_EPS)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(got, composed(head, hidden, probs, 1), rtol=1e-5, atol=1e-6)


def test_non_contiguous_inputs():
    head, hidden, probs = make(3, 12, 50, 8, 1, 2)
    wide = torch.stack([probs, probs], -1).flatten(1)[:, ::2]
    assert not wide.is_contiguous() and torch.equal(wide, probs)
    strided = [w.T.contiguous().T if w.dim() == 2 else w for w in head.weights()]  # transposed storage
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(ops.acceptance_head(hidden.T.contiguous().T, wide, strided, 0, backend="cpu"),
                               ops.acceptance_head(hidden, probs, head.weights(), 0, backend="cpu"), rtol=0, atol=0)


def test_no_rows():
    head, hidden, probs = make(2, 12, 50, 8, 1, 2)
    for backend in ("cpu", "torch"):
        got = ops.acceptance_head(hidden[:0], probs[:0], head.weights(), 0, backend=backend)
        assert got.shape == (0,) and got.dtype == torch.float32


def test_specdecpp_decides_with_the_kernel_as_with_torch_ops(tmp_path):
    head, hidden, probs = make(4, 24, 40, 16, 1, 2, seed=3)
    head.save(tmp_path / "h.safetensors", kind="specdecpp", threshold=0.5)
    policy = SpecDecPP(tmp_path / "h.safetensors")

    class Draft:
        device = torch.device("cpu")
        config = type("Config", (), {"hidden_size": 24})

    with torch.no_grad():
        for greedy in (True, False):
            fused, plain = (policy.start(Call(4, greedy, None, Draft())) for _ in range(2))
            plain.fused = False
            assert fused.fused
            plans = [controller.plan(RoundState(4)) for controller in (fused, plain)]
            survival = [torch.ones(4), torch.ones(4)]
            for step in (1, 2, 3):
                tokens = probs.argmax(-1)
                # each step's predicted acceptance, whose running product the plan stops by
                for i, controller in enumerate((fused, plain)):
                    survival[i] = survival[i] * controller._accept(probs, hidden)
                torch.testing.assert_close(survival[0], survival[1], rtol=1e-5, atol=1e-6)
                assert torch.equal(plans[0].keep_drafting(step, probs, tokens, hidden),
                                   plans[1].keep_drafting(step, probs, tokens, hidden))


def test_errors_name_the_argument():
    head, hidden, probs = make(2, 8, 10, 4, 1, 2)
    weights = head.weights()
    with pytest.raises(ValueError, match="weights: expected 4 \\+ 6 \\* depth"):
        ops.acceptance_head(hidden, probs, weights[:-1], 0)
    with pytest.raises(ValueError, match="weights\\[2\\]"):
        ops.acceptance_head(hidden, probs, weights[:2] + [weights[2][:3]] + weights[3:], 0)
    with pytest.raises(ValueError, match="weights\\[0\\]"):
        ops.acceptance_head(torch.randn(2, 9), probs, weights, 0)
    with pytest.raises(ValueError, match="column: expected 0 <= column < 2"):
        ops.acceptance_head(hidden, probs, weights, 2)
    with pytest.raises(ValueError, match="probs: expected \\[B=2, V>=2\\]"):
        ops.acceptance_head(hidden, probs[:1], weights, 0)
    with pytest.raises(ValueError, match="hidden: expected dtype torch.float32"):
        ops.acceptance_head(hidden.double(), probs, weights, 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.acceptance_head(hidden, probs, weights, 0, backend="cuda")
