"""HF's generation settings of one call: what the caller passed, else the target's
``generation_config`` (as HF's generate merges them), checked and turned into the sampler's
warpers, the processors and the stop strings."""
from __future__ import annotations

from dataclasses import dataclass

from spec_ext.processing import Grammar, Matchers, Processors, Settings
from spec_ext.processing.stop import StopStrings

# the processors' settings (spec_ext.processing.Settings), read from generation_config when not passed
PROCESSOR_SETTINGS = ("sequence_bias", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length",
                      "min_new_tokens", "suppress_tokens", "begin_suppress_tokens")
# the warpers beyond temperature, top-k and top-p (sampling only)
WARPER_SETTINGS = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
OTHER_SETTINGS = ("num_return_sequences", "stop_strings", "token_healing", "renormalize_logits")
SETTINGS = PROCESSOR_SETTINGS + WARPER_SETTINGS + OTHER_SETTINGS


def check_names(settings: dict) -> None:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a generation setting spec_ext knows (it takes HF's: "
                         f"{', '.join(SETTINGS)})")


def _value(settings: dict, config, name: str):
    return settings[name] if settings.get(name) is not None else getattr(config, name, None)


@dataclass
class CallSettings:
    """What the settings of one call come to."""
    processor: Settings
    warpers: dict
    num_return_sequences: int
    stop_strings: list[str] | str | None
    token_healing: bool


def resolve_settings(target, settings: dict, eos: list[int], logits_processor, prefix_allowed_tokens_fn,
                     sampling: bool) -> CallSettings:
    """The call's settings (``settings`` by HF's names, else ``target.generation_config``'s),
    each checked by name."""
    check_names(settings)
    config = target.generation_config
    get = {name: _value(settings, config, name) for name in SETTINGS}
    s = Settings(eos=list(eos))
    if get["sequence_bias"] is not None:
        s.sequence_bias = _sequence_bias(get["sequence_bias"])
    if get["repetition_penalty"] is not None:
        s.repetition_penalty = _positive_float(get["repetition_penalty"], "repetition_penalty")
    s.no_repeat_ngram_size = _count(get["no_repeat_ngram_size"], "no_repeat_ngram_size")
    if get["bad_words_ids"] is not None:
        s.bad_words_ids = _id_lists(get["bad_words_ids"], "bad_words_ids")
    s.min_new_tokens = _count(get["min_new_tokens"], "min_new_tokens")
    # as HF (_prepare_generated_length): min_new_tokens, when set, replaces min_length
    s.min_length = 0 if get["min_new_tokens"] is not None else _count(get["min_length"], "min_length")
    s.suppress_tokens = _ids(get["suppress_tokens"], "suppress_tokens")
    s.begin_suppress_tokens = _ids(get["begin_suppress_tokens"], "begin_suppress_tokens")
    if logits_processor is not None:
        s.logits_processor = _processors(logits_processor)
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise ValueError(f"prefix_allowed_tokens_fn: expected a function (batch_id, input_ids) -> list of ids, "
                         f"got {prefix_allowed_tokens_fn!r}")
    s.prefix_allowed_tokens_fn = prefix_allowed_tokens_fn
    warpers = {name: get[name] for name in WARPER_SETTINGS} if sampling else {}
    n = get["num_return_sequences"] or 1
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_return_sequences: must be a positive int, got {n!r}")
    if n > 1 and not sampling:
        raise ValueError(f"num_return_sequences={n}: greedy decoding returns one sequence per prompt "
                         f"(as HF without beams); sample (do_sample=True / temperature > 0) for several")
    return CallSettings(s, warpers, n, get["stop_strings"], bool(get["token_healing"]))


def sampling_temperature(do_sample, temperature, config) -> float:
    """The temperature an HF-style call ``generate(do_sample=..., temperature=...)`` samples
    at (0.0: greedy), each None taken from the target's ``generation_config``. As HF's
    generate (its TemperatureLogitsWarper), sampling at a temperature that is not > 0 is
    refused rather than decoded greedily."""
    if not (config.do_sample if do_sample is None else do_sample):
        return 0.0
    temperature = (1.0 if config.temperature is None else config.temperature) if temperature is None else temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        greedy = " (for greedy decoding set do_sample=False)" if temperature == 0 else ""
        raise ValueError(f"temperature: must be a positive number when do_sample=True, got {temperature!r}{greedy}")
    return float(temperature)


def make_processors(call: CallSettings, rows: list[list[int]], width: int, tokenizer, grammar, target_vocab: int
                    ) -> Processors | None:
    """The call's processors (None when nothing is set); ``rows`` the prompts after
    num_return_sequences; ``width`` the widest logits either model gives."""
    s = call.processor
    too_big = sorted({t for k in [*s.sequence_bias, *s.bad_words_ids] for t in k if t >= target_vocab})
    if too_big:
        raise ValueError(f"sequence_bias / bad_words_ids: token ids {too_big} are past the target's vocabulary "
                         f"({target_vocab})")
    matchers = None
    if grammar is not None:
        grammars = grammar if isinstance(grammar, (list, tuple)) else [grammar] * len(rows)
        if len(grammars) != len(rows):
            raise ValueError(f"grammar: got {len(grammars)} grammars for {len(rows)} rows (one per call or one "
                             f"per prompt{' times num_return_sequences' if call.num_return_sequences > 1 else ''})")
        if not all(g is None or isinstance(g, Grammar) for g in grammars):
            raise ValueError("grammar: expected a spec_ext.Grammar (Grammar.json_schema, .regex or .ebnf), "
                             "a list of them (None for a row without one), or None")
        if tokenizer is None:
            raise ValueError("grammar: needs the target's tokenizer (pass tokenizer=)")
        if any(g is not None for g in grammars):
            matchers = Matchers(grammars, tokenizer, target_vocab, call.processor.eos)
    processors = Processors(call.processor, width, matchers)
    return processors if processors else None


def stop_strings(call: CallSettings, tokenizer, rows: list[list[int]]) -> StopStrings | None:
    return None if not call.stop_strings else StopStrings(call.stop_strings, tokenizer, rows)


def _positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: must be a positive number, got {value!r}")
    return float(value)


def _count(value, name: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
    return value


def _ids(value, name: str) -> list[int]:
    if value is None:
        return []
    values = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"{name}: expected a list of token ids, got {value!r}")
    return list(values)


def _id_lists(value, name: str) -> list[list[int]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name}: expected a non-empty list of token-id lists, got {value!r}")
    return [_ids(v, name) for v in value]


def _sequence_bias(value) -> dict[tuple[int, ...], float]:
    """HF's two spellings: {(ids...): bias} or [[[ids...], bias], ...]."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    try:
        result = {tuple(_ids(list(ids), "sequence_bias")): float(bias) for ids, bias in pairs}
    except (TypeError, ValueError):
        raise ValueError(f"sequence_bias: expected {{(ids...): bias}} or [[[ids...], bias], ...], "
                         f"got {value!r}") from None
    if not result or any(len(k) == 0 for k in result):
        raise ValueError(f"sequence_bias: expected non-empty token sequences, got {value!r}")
    return result


def _processors(value) -> list:
    """A LogitsProcessorList (or list) of HF-contract processors; those that keep state between
    calls or depend on a row's index in the batch are refused by name."""
    from transformers import generation as g
    processors = list(value) if isinstance(value, (list, tuple)) else [value]
    row_dependent = {g.PrefixConstrainedLogitsProcessor: "pass prefix_allowed_tokens_fn= instead",
                     g.ClassifierFreeGuidanceLogitsProcessor: "it pairs rows by their index in the batch",
                     g.UnbatchedClassifierFreeGuidanceLogitsProcessor: "it runs the model on its own cache"}
    for p in processors:
        if not callable(p):
            raise ValueError(f"logits_processor: {p!r} is not callable (input_ids, scores) -> scores")
        module = type(p).__module__.split(".")[0]
        if module in ("xgrammar", "llguidance", "outlines"):
            raise ValueError(f"logits_processor: {module}'s HF LogitsProcessor keeps state between calls (it "
                             f"consumes the last token of each call), which no speculative decoding can honour; "
                             f"pass grammar=spec_ext.Grammar... instead")
        if type(p) in row_dependent:
            raise ValueError(f"logits_processor: {type(p).__name__} is not supported under speculation: spec_ext "
                             f"calls processors on the positions of each prefix length, in varying batches; "
                             f"{row_dependent[type(p)]}")
        if isinstance(p, g.RepetitionPenaltyLogitsProcessor) and hasattr(p.prompt_ignore_length, "shape"):
            raise ValueError("logits_processor: a RepetitionPenaltyLogitsProcessor with a per-row "
                             "prompt_ignore_length depends on the batch; pass repetition_penalty= instead")
    return processors
