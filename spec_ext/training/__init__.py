"""Making the learned policies' predictors for any pair (the top layer: it runs the engine
to measure costs). ``benchmarks/train_policies.py`` is the pipeline for the bundled pair.

* :mod:`.corpus`: the target's own continuations of prompts from text files, their cached features,
  checkpoints (what every drafter recipe shares: :mod:`.head` for EAGLE-3 heads, :mod:`.dflash` for
  block drafters);
* :mod:`.data`: teacher-forced features and labels from the target's own continuations;
* :mod:`.fit`: training a predictor, early-stopped on held-out sequences;
* :mod:`.costs`: round costs and decision costs measured in the loop;
* :mod:`.replay`: decoding replayed on validation runs and acceptance grids to choose settings, and bounds.
"""
from spec_ext.training.corpus import continuations
from spec_ext.training.costs import COST_KS, decision_ms, round_costs
from spec_ext.training.data import (accepted_runs, branch_classes, by_sequence, dataset, features_and_labels,
                                    steps_ahead)
from spec_ext.training.fit import asymmetric_l1, train_predictor
from spec_ext.training.replay import (MAX_LENGTH, OFFSETS, THRESHOLDS, batch_choices, batch_round_ms, best_of, bounds,
                                      replay, replay_batches, simulated_batch_tokens_per_ms, simulated_tokens_per_ms,
                                      specdecpp_lengths)

__all__ = ["COST_KS", "MAX_LENGTH", "OFFSETS", "THRESHOLDS", "accepted_runs", "asymmetric_l1", "batch_choices",
           "batch_round_ms", "best_of", "bounds", "branch_classes", "by_sequence", "continuations", "dataset",
           "decision_ms", "features_and_labels", "replay", "replay_batches", "round_costs",
           "simulated_batch_tokens_per_ms", "simulated_tokens_per_ms", "specdecpp_lengths", "steps_ahead",
           "train_predictor"]
