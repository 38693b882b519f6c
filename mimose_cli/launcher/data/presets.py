"""The synthetic data's length distributions, torch-free: the recipe checks its lengths against them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LengthPreset:
    mean: float
    """Mean tokenized length of one model input (one choice for multiple choice)."""
    std: float
    """Standard deviation of the tokenized length."""
    min_length: int
    """Shortest length generated."""
    source: str
    """Where the figures come from."""


# Tokenized lengths with the BERT/RoBERTa word-piece tokenizers, special tokens included.
# These are estimates, not measurements of the tokenized data sets (no data is downloaded here);
# docs/DATA.md explains each, and how to measure the real distribution with data.source=hf.
LENGTH_PRESETS = {
    # Mimose paper (arXiv 2209.02478) Fig. 1: SWAG lengths spread ~20-130, right-skewed, mean ~50.
    "swag": LengthPreset(mean=50.0, std=18.0, min_length=20,
                         source="estimate read from the Mimose paper's Fig. 1 (SWAG)"),
    # SQuAD v1.1 paragraphs average ~120 words and questions ~10 words (Rajpurkar et al. 2016);
    # word pieces add ~25 %; a long right tail reaches max_length 384/512.
    "squad": LengthPreset(mean=165.0, std=65.0, min_length=40,
                          source="estimate from SQuAD v1.1 word counts x ~1.25 word pieces/word"),
    # QQP question pairs: ~11 words per question, two questions, three special tokens.
    "qqp": LengthPreset(mean=30.0, std=15.0, min_length=8,
                        source="estimate from QQP question word counts (~11 words each)"),
}

# Image sides in pixels (task image_classification): multi-scale training, each image resized so
# its side falls between a small and a large scale, as detection and progressive-resizing recipes
# do; sides are rounded to a multiple of data.image_multiple.
IMAGE_PRESETS = {
    "multiscale": LengthPreset(mean=160.0, std=56.0, min_length=64,
                               source="multi-scale training: sides drawn around 160 px, 64 px and up"),
}

MIN_SYNTHETIC_LENGTH = 8
