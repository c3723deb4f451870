"""The model layer: everything that touches transformers.

* :mod:`spec_ext.models.cache`: :class:`SpecCache`, a transformers ``Cache`` with per-row
  lengths (rollback by lengths, tree commits by ``compact_kv``), and :class:`MirroredCache`,
  the leading rank's cache of a tensor-parallel target;
* :mod:`spec_ext.models.hf`: the ``"spec_ext"`` attention function, model checks
  (:func:`unsupported_reason`: why spec_ext cannot decode a model at all), and
  :func:`forward` (T new tokens per row over a SpecCache, chain or tree; vocabularies
  padded to the target's; with ``layers``, the hidden states of those layers as features,
  :func:`aux_layer_ids` picking EAGLE-3's), with :func:`forward_path` saying which forward
  a model takes;
* :mod:`spec_ext.models.lean`: the same arithmetic as the Llama/Mistral/Qwen2/Qwen3 modules
  without their per-call machinery (``lean.why_not_lean`` says why a model cannot take it,
  :func:`hf_modules` keeps models off it).
"""
from spec_ext.models.cache import MirroredCache, SpecCache, mirrored, split_size
from spec_ext.models.hf import (Forward, attention_implementation, aux_layer_ids, check_model, check_pair, forward,
                                forward_path, num_layers, unsupported_reason, vocabulary_size)
from spec_ext.models.lean import hf_modules

__all__ = ["Forward", "MirroredCache", "SpecCache", "attention_implementation", "aux_layer_ids", "check_model", "check_pair",
           "forward", "forward_path", "hf_modules", "mirrored", "num_layers", "split_size", "unsupported_reason",
           "vocabulary_size"]
