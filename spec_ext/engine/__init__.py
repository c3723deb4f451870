"""The engines: the serial drafter-verifier loop (:mod:`.serial`), the parallel one where
draft and target run at once (:mod:`.parallel`), and :func:`generate` / :func:`accelerate`,
which pick the engine a policy needs (:mod:`.generate`)."""
from spec_ext.drafters import Sampler
from spec_ext.engine.common import Output, Stats
from spec_ext.engine.generate import Accelerated, accelerate, generate
from spec_ext.engine.parallel import PeerError, serve_draft, shutdown, split_threads

__all__ = ["Accelerated", "Output", "PeerError", "Sampler", "Stats", "accelerate", "generate", "serve_draft",
           "shutdown", "split_threads"]
