"""What changes the target's distribution at a position from that position's own prefix: HF's
logits processors (:class:`Processors`, :class:`Settings`), the user's and a grammar
(:class:`Grammar`), applied alike to every verified position, every tree node and every
draft step, so the output is the one HF's generate gives with the same settings.

| module | what |
|---|---|
| ``positions`` | which prefix each processed position continues (chains, trees, draft steps) |
| ``processors`` | HF's settings in HF's order, batched on the device; user processors |
| ``grammar`` | :class:`Grammar` and the per-row llguidance matchers |
| ``stop`` | ``stop_strings``: where a row's text ends |
"""
from spec_ext.processing.grammar import Grammar, Matchers
from spec_ext.processing.positions import Positions
from spec_ext.processing.processors import Processors, Settings

__all__ = ["Grammar", "Matchers", "Positions", "Processors", "Settings"]
