"""Synthetic data: token sequences whose lengths follow the real data sets' length distributions.

Nothing is downloaded. What matters to a memory planner is the sequence of padded input sizes,
so lengths are drawn from a lognormal fitted to each data set's tokenized-length mean and
standard deviation, clipped to [min_length, max_length]. The tokens carry a simple learnable
signal so that the training loss falls:

- sequence_classification: ``[CLS] A [SEP] B [SEP]``; sentence A holds the key token of its
  label (one reserved content id per class).
- multiple_choice: ``[CLS] context [SEP] ending_i [SEP]`` per choice; only the correct ending
  holds the marker token.
- question_answering: ``[CLS] question [SEP] passage [SEP]``; the answer span in the passage is
  enclosed by span-open/span-close tokens; start/end are the span's first and last tokens.
- causal_lm: a short random motif repeated to the sequence length (learnable by copying).
- image_classification: square images whose side follows the preset (a multiple of
  ``data.image_multiple``); noise whose first channel's mean says the label. An example holds
  its side, label and seed; the collator draws its pixels.
"""

from dataclasses import dataclass

import numpy as np

from mimose_cli.launcher.data.presets import IMAGE_PRESETS, LENGTH_PRESETS

NUM_RESERVED_IDS = 16
"""Ids below this are structural tokens ([CLS], [SEP], markers), never ordinary content."""
VALIDATION_STREAM = 3
"""``data_rng`` stream of the validation examples (0: training examples, 1: epoch order, 2: the
planners' profiling batches), so they are new examples of the training data's distribution."""


@dataclass(frozen=True)
class TokenSpace:
    """Which ids play which part in synthetic sequences, for one model config."""

    cls: int
    sep: int
    marker: int
    span_open: int
    span_close: int
    content: np.ndarray
    """Ordinary token ids (no pad, bos, eos or structural id)."""

    @classmethod
    def for_config(cls, config) -> "TokenSpace":
        vocab_size = config.vocab_size
        specials = {getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        structural = [i for i in range(NUM_RESERVED_IDS) if i != config.pad_token_id][:5]
        content = np.arange(NUM_RESERVED_IDS, vocab_size)
        content = content[~np.isin(content, [s for s in specials if s is not None])]
        if len(content) < 64:
            raise ValueError(f"vocab_size={vocab_size} is too small for synthetic data; use >= 128")
        return cls(*structural, content=content)


def data_rng(*keys: int) -> np.random.Generator:
    """A generator seeded by (seed, stream, ...); negative seeds are fine."""
    return np.random.default_rng([k % 2**64 for k in keys])


def length_params(data) -> tuple[float, float, int]:
    """(mean, std, min_length) of the recipe's synthetic lengths: the preset, then overrides."""
    preset = {**LENGTH_PRESETS, **IMAGE_PRESETS}[data.preset]
    mean = preset.mean if data.length_mean is None else data.length_mean
    std = preset.std if data.length_std is None else data.length_std
    min_length = preset.min_length if data.min_length is None else data.min_length
    return mean, std, min_length  # DataConfig checked them against max_length


def sample_lengths(rng, n: int, mean: float, std: float, min_length: int, max_length: int) -> np.ndarray:
    """``n`` lengths from the lognormal with this mean and std, rounded and clipped."""
    sigma2 = np.log1p((std / mean) ** 2)
    lengths = rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), n)
    return np.clip(np.rint(lengths), min_length, max_length).astype(int)


def _tokens(rng, space: TokenSpace, n: int, pool=None) -> list:
    pool = space.content if pool is None else pool
    return pool[rng.integers(0, len(pool), n)].tolist()


def _pair(space: TokenSpace, first: list, second: list) -> dict:
    ids = [space.cls, *first, space.sep, *second, space.sep]
    return {"input_ids": ids, "token_type_ids": [0] * (len(first) + 2) + [1] * (len(second) + 1)}


def _classification(rng, space: TokenSpace, length: int, num_labels: int) -> dict:
    keys, pool = space.content[:num_labels], space.content[num_labels:]
    label = int(rng.integers(num_labels))
    len_a = max(1, round((length - 3) * rng.uniform(0.3, 0.7)))
    first = _tokens(rng, space, len_a, pool)
    first[rng.integers(len_a)] = int(keys[label])
    return {**_pair(space, first, _tokens(rng, space, length - 3 - len_a, pool)), "label": label}


def _multiple_choice(rng, space: TokenSpace, length: int, num_choices: int, max_length: int) -> dict:
    pool = space.content
    len_context = max(1, round((length - 3) * rng.uniform(0.35, 0.6)))
    context = _tokens(rng, space, len_context, pool)
    label = int(rng.integers(num_choices))
    choices = []
    for choice in range(num_choices):
        len_ending = length - 3 - len_context + int(rng.integers(-3, 4))
        len_ending = int(np.clip(len_ending, 1, max_length - 3 - len_context))
        ending = _tokens(rng, space, len_ending, pool)
        if choice == label:
            ending[rng.integers(len_ending)] = space.marker
        choices.append(_pair(space, context, ending))
    return {key: [c[key] for c in choices] for key in ("input_ids", "token_type_ids")} | {"label": label}


def _question_answering(rng, space: TokenSpace, length: int) -> dict:
    len_question = max(1, round((length - 3) * rng.uniform(0.08, 0.2)))
    len_passage = length - 3 - len_question
    len_span = int(rng.integers(1, min(5, len_passage - 2) + 1))
    open_at = int(rng.integers(0, len_passage - len_span - 1))
    passage = _tokens(rng, space, len_passage)
    passage[open_at] = space.span_open
    passage[open_at + len_span + 1] = space.span_close
    example = _pair(space, _tokens(rng, space, len_question), passage)
    start = 2 + len_question + open_at + 1  # [CLS] question [SEP] then the passage
    return {**example, "start_positions": start, "end_positions": start + len_span - 1}


def _causal_lm(rng, space: TokenSpace, length: int) -> dict:
    motif = _tokens(rng, space, int(rng.integers(2, 9)))
    ids = (motif * (length // len(motif) + 1))[:length]
    return {"input_ids": ids, "token_type_ids": [0] * length}


def image_sides(lengths: np.ndarray, multiple: int, max_side: int) -> np.ndarray:
    """Sides rounded to the nearest multiple of ``multiple``, at least one multiple, at most the
    largest multiple within ``max_side``."""
    top = max(multiple, max_side // multiple * multiple)
    return np.clip(np.rint(lengths / multiple).astype(int) * multiple, multiple, top)


def image_pixels(example: dict, channels: int, num_labels: int) -> np.ndarray:
    """An image example's pixels (channels x side x side, float32): noise from its seed, the first
    channel shifted by its label (a signal global pooling learns)."""
    side = example["side"]
    pixels = data_rng(example["seed"], 4).standard_normal((channels, side, side), dtype=np.float32)
    pixels[0] += 2.0 * example["label"] / max(1, num_labels - 1) - 1.0
    return pixels


def build_synthetic(recipe, config, validation: bool = False) -> list:
    """``data.num_examples`` examples for ``recipe.task`` (``validation``: ``data.validation_examples``
    others, from a seed stream of their own), the same for the same ``recipe.seed``."""
    data = recipe.data
    mean, std, min_length = length_params(data)
    rng = data_rng(recipe.seed, VALIDATION_STREAM) if validation else data_rng(recipe.seed, 0)
    count = data.validation_examples if validation else data.num_examples
    lengths = sample_lengths(rng, count, mean, std, min_length, data.max_length)
    if recipe.task == "image_classification":
        sides = image_sides(lengths, data.image_multiple, data.max_length)
        labels = rng.integers(0, data.num_labels, count)
        seeds = rng.integers(0, 2**63, count)
        return [{"side": int(s), "label": int(y), "seed": int(k)} for s, y, k in zip(sides, labels, seeds)]
    space = TokenSpace.for_config(config)
    if recipe.task == "sequence_classification":
        return [_classification(rng, space, n, data.num_labels) for n in lengths]
    if recipe.task == "multiple_choice":
        return [_multiple_choice(rng, space, n, data.num_choices, data.max_length) for n in lengths]
    if recipe.task == "question_answering":
        return [_question_answering(rng, space, n) for n in lengths]
    if recipe.task == "causal_lm":
        return [_causal_lm(rng, space, n) for n in lengths]
    raise ValueError(f"task={recipe.task!r} has no synthetic data")
