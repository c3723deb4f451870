"""spec_ext.training's replay helpers, against rounds worked out by hand: the
bounds it reports (what any draft-length rule could reach) must be right to be cited."""
import torch

from spec_ext.training import MAX_LENGTH, accepted_runs, bounds, specdecpp_lengths, steps_ahead


def test_survival_multiplies_the_chances_ahead_of_each_position():
    chances = torch.tensor([[0.5, 0.8, 0.25]])
    got = steps_ahead(chances, MAX_LENGTH, past_end=0.0).cumprod(-1)
    assert got.shape == (1, 3, MAX_LENGTH)
    torch.testing.assert_close(got[0, 0, :4], torch.tensor([0.5, 0.4, 0.1, 0.0]))
    torch.testing.assert_close(got[0, 2, :2], torch.tensor([0.25, 0.0]))
    torch.testing.assert_close(steps_ahead(chances, MAX_LENGTH, past_end=1.0).cumprod(-1)[0, 2, :3],
                               torch.tensor([0.25, 0.25, 0.25]))


def test_specdecpp_lengths_stop_where_the_predicted_survival_drops():
    chances = steps_ahead(torch.tensor([[0.9, 0.9, 0.5, 0.9]]), MAX_LENGTH, past_end=1.0)
    # from 0: survival 0.9, 0.81, 0.405 -> 1 - s > 0.5 first at the third draft
    assert specdecpp_lengths(chances, 0.5)[0, 0] == 3
    # from 3: 0.9 then 1 past the end: never stops, the longest draft
    assert specdecpp_lengths(chances, 0.5)[0, 3] == MAX_LENGTH


def test_bounds_by_hand():
    P = 40
    accept = torch.zeros(2, P, dtype=torch.bool)
    accept[0, :3] = True  # row 0: a run of 3 from position 0; row 1: rejected at once
    chances = torch.full((2, P), 0.5)
    round_ms = [10.0 + k for k in range(MAX_LENGTH + 1)]
    alone, batch = bounds(accepted_runs(accept.float(), MAX_LENGTH), steps_ahead(chances, MAX_LENGTH), round_ms,
                          lambda k, n: 10.0 + k)
    assert alone["oracle"][0, 0] == 3 and alone["oracle"][1, 0] == 1  # never fewer than one draft
    # chance 0.5 each: k drafts yield 1 + 0.5 + 0.25 + ... tokens for 10 + k ms:
    # k=1 1.5/11 = 0.136, k=2 1.75/12 = 0.146, k=3 1.875/13 = 0.144
    assert alone["chances known"][0, 0] == 2
    rows, roots = torch.tensor([0, 1]), torch.tensor([0, 0])
    # runs 3 and 0 drafted together: k=2 (2+0+2)/12 = 0.333, k=3 5/13 = 0.385, k=4 5/14 = 0.357
    assert batch["oracle"](rows, roots) == 3
    # expected tokens of both rows: k=2 3.5/12 = 0.292, k=3 3.75/13 = 0.288
    assert batch["chances known"](rows, roots) == 2
