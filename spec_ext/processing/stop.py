"""``stop_strings``: a row ends at the token that completes one of them, as HF's
``StopStringCriteria`` decides (the completing token is kept)."""
from __future__ import annotations

import torch


class StopStrings:
    """HF's criteria, asked after every committed token of a row. ``prompts`` each row's
    prompt as HF's input_ids holds it (the criteria read the tail of the row: padding too)."""

    def __init__(self, stop_strings: str | list[str], tokenizer, prompts: list[list[int]]):
        from transformers.generation import StopStringCriteria
        if tokenizer is None:
            raise ValueError("stop_strings: needs the target's tokenizer (pass tokenizer=)")
        self.criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
        self.tail = self.criteria.maximum_token_len
        self.prompts = prompts

    def cut(self, r: int, new: list[int], tokens: list[int]) -> int | None:
        """How many of ``tokens`` row ``r`` keeps when they follow its ``new`` tokens so far
        (the one that completes a stop string is the last), or None when none completes one."""
        row = self.prompts[r] + new + tokens
        start = len(row) - len(tokens)
        windows = [row[max(0, end - self.tail):end] for end in range(start + 1, len(row) + 1)]
        width = max(map(len, windows))
        if any(len(w) < width for w in windows):  # a short row: its first windows are the whole row
            hits = [bool(self.criteria(torch.tensor([w]), None)[0]) for w in windows]
        else:
            hits = self.criteria(torch.tensor(windows), None).tolist()
        return next((i + 1 for i, hit in enumerate(hits) if hit), None)
