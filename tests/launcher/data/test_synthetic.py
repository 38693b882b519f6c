import numpy as np
import pytest

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import example_length
from mimose_cli.launcher.data.presets import LENGTH_PRESETS
from mimose_cli.launcher.data.synthetic import TokenSpace
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.recipe import DataConfig, ModelConfig, Recipe, RecipeError, recipe_from_dict

TASKS = ("multiple_choice", "question_answering", "sequence_classification", "causal_lm")


def recipe(task="sequence_classification", model_type="bert", seed=0, **data):
    data = {"num_examples": 200, **data}
    return Recipe(task=task, model=ModelConfig(type=model_type), data=DataConfig(**data), seed=seed)


def dataset(r):
    return build_dataset(r, model_config(r))


def lengths(examples):
    return np.array([example_length(e) for e in examples])


@pytest.mark.parametrize("preset", sorted(LENGTH_PRESETS))
def test_lengths_follow_the_preset(preset):
    expected = LENGTH_PRESETS[preset]
    n = lengths(dataset(recipe(preset=preset, num_examples=4000, max_length=512)))
    assert abs(n.mean() - expected.mean) < 0.05 * expected.mean
    assert abs(n.std() - expected.std) < 0.15 * expected.std
    assert n.min() >= expected.min_length and n.max() <= 512
    assert np.median(n) < n.mean()  # skewed right, as tokenized lengths are


def test_length_overrides_and_truncation():
    n = lengths(dataset(recipe(length_mean=100.0, length_std=10.0, min_length=90, max_length=110,
                               num_examples=2000)))
    assert abs(n.mean() - 100) < 2
    assert n.min() == 90 and n.max() == 110


def test_squad_tail_reaches_max_length():
    n = lengths(dataset(recipe("question_answering", preset="squad", max_length=384, num_examples=4000)))
    assert n.max() == 384


@pytest.mark.parametrize("data, named", [
    ({"min_length": 2}, "data.min_length=2"),
    ({"min_length": 40, "max_length": 30}, "data.min_length=40"),
    ({"max_length": 10}, "data.max_length=10"),  # under the swag preset's shortest, 20
])
def test_invalid_lengths_are_named(data, named):
    with pytest.raises(RecipeError, match=f"{named} is invalid"):
        recipe_from_dict({"data": data})


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlnet", "gpt2"])
def test_token_ids_are_valid_content(task, model_type):
    r = recipe(task, model_type)
    config = model_config(r)
    for example in dataset(r):
        rows = example["input_ids"] if task == "multiple_choice" else [example["input_ids"]]
        for ids in rows:
            assert 0 <= min(ids) and max(ids) < config.vocab_size
            assert config.pad_token_id not in ids


def test_same_seed_same_data_other_seed_other_data():
    assert dataset(recipe(seed=3)) == dataset(recipe(seed=3))
    assert dataset(recipe(seed=3)) != dataset(recipe(seed=4))


def test_classification_label_is_the_key_token_in_the_first_sentence():
    r = recipe(num_labels=3)
    keys = TokenSpace.for_config(model_config(r)).content[:3].tolist()
    for example in dataset(r):
        first = [t for t, s in zip(example["input_ids"], example["token_type_ids"]) if s == 0]
        present = [label for label, key in enumerate(keys) if key in first]
        assert present == [example["label"]]
        assert not set(keys) & set(example["input_ids"][len(first):])


def test_only_the_correct_choice_holds_the_marker():
    r = recipe("multiple_choice", preset="swag", num_choices=4)
    marker = TokenSpace.for_config(model_config(r)).marker
    examples = dataset(r)
    for example in examples:
        assert len(example["input_ids"]) == 4
        has_marker = [marker in ids for ids in example["input_ids"]]
        assert has_marker == [c == example["label"] for c in range(4)]
    # Choices share a context but their lengths vary a little.
    assert any(len({len(ids) for ids in e["input_ids"]}) > 1 for e in examples)


def test_answer_span_sits_between_the_span_markers():
    r = recipe("question_answering", preset="squad", max_length=384)
    space = TokenSpace.for_config(model_config(r))
    for e in dataset(r):
        start, end, ids = e["start_positions"], e["end_positions"], e["input_ids"]
        assert 0 < start <= end < len(ids)
        assert ids[start - 1] == space.span_open and ids[end + 1] == space.span_close
        assert e["token_type_ids"][start] == 1


def test_causal_lm_sequences_repeat_a_motif():
    for e in dataset(recipe("causal_lm", "gpt2")):
        ids = e["input_ids"]
        period = next(p for p in range(2, 9) if ids[p:] == ids[:-p])
        assert period <= 8
