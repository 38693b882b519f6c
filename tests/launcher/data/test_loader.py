import pytest
import torch

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader, example_length, make_batch, max_input_size
from mimose_cli.launcher.data.synthetic import TokenSpace
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.launcher.recipe import DataConfig, ModelConfig, Recipe, TrainingConfig

TASKS = ("multiple_choice", "question_answering", "sequence_classification", "causal_lm")


def recipe(task="sequence_classification", model_type="bert", seed=0, batch_size=8, **data):
    data = {"num_examples": 100, "preset": "qqp", **data}
    return Recipe(task=task, model=ModelConfig(type=model_type), data=DataConfig(**data),
                  training=TrainingConfig(batch_size=batch_size), seed=seed)


def setup(r):
    config = model_config(r)
    return build_dataset(r, config), config


def batches(r, epoch=0, skip_batches=0):
    examples, config = setup(r)
    return list(build_dataloader(r, examples, config, epoch=epoch, skip_batches=skip_batches))


def padding_tokens(loader_batches):
    return sum(int((b["attention_mask"] == 0).sum()) for b in loader_batches)


@pytest.mark.parametrize("task,model_type", [
    (task, model_type) for task in TASKS for model_type in ("bert", "xlnet", "gpt2")
    if (task, model_type) != ("multiple_choice", "gpt2")  # gpt2 has no multiple-choice head
])
def test_each_batch_is_padded_to_its_longest_example(task, model_type):
    r = recipe(task, model_type, num_choices=3)
    examples, config = setup(r)
    loader = build_dataloader(r, examples, config)
    seen = []
    for indices, batch in zip(loader.batches, loader):
        length = max(example_length(examples[i]) for i in indices)
        assert batch["input_ids"].shape[-1] == length
        rows = batch["attention_mask"].reshape(-1, length).sum(-1).tolist()
        expected = [len(ids) for i in indices for ids in
                    (examples[i]["input_ids"] if task == "multiple_choice" else [examples[i]["input_ids"]])]
        assert rows == expected
        assert ("token_type_ids" in batch) == (model_type == "bert")
        seen += indices
    assert sorted(seen) == list(range(len(examples)))
    assert len(loader) == loader.batches_per_epoch == 13  # 100 examples, batch 8, last batch kept
    assert len(batches(r)) == 13 and {len(b) for b in loader.batches} == {8, 4}


def test_causal_lm_labels_ignore_padding():
    batch = batches(recipe("causal_lm", "gpt2"))[0]
    mask = batch["attention_mask"].bool()
    assert torch.equal(batch["labels"][mask], batch["input_ids"][mask])
    assert (batch["labels"][~mask] == -100).all() and (~mask).any()


def test_xlnet_pads_left_and_shifts_answer_positions():
    r = recipe("question_answering", "xlnet", preset="squad", max_length=384)
    space = TokenSpace.for_config(model_config(r))
    for batch in batches(r):
        assert (batch["attention_mask"][:, -1] == 1).all()
        rows = torch.arange(len(batch["input_ids"]))
        assert (batch["input_ids"][rows, batch["start_positions"] - 1] == space.span_open).all()
        assert (batch["input_ids"][rows, batch["end_positions"] + 1] == space.span_close).all()


def test_same_seed_same_batches_other_epoch_other_order():
    r = recipe()
    first, again = batches(r), batches(r)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))
    examples, config = setup(r)
    orders = [build_dataloader(r, examples, config, epoch=e).batches for e in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2]


def test_no_shuffle_keeps_file_order():
    examples, config = setup(r := recipe(shuffle=False))
    order = [i for b in build_dataloader(r, examples, config, epoch=3).batches for i in b]
    assert order == list(range(len(examples)))


def test_group_by_length_reduces_padding_and_starts_with_the_longest():
    r_plain, r_grouped = recipe(num_examples=400), recipe(num_examples=400, group_by_length=True)
    examples, config = setup(r_grouped)
    grouped = build_dataloader(r_grouped, examples, config)
    assert padding_tokens(grouped) < padding_tokens(batches(r_plain)) / 3
    longest = max(example_length(e) for e in examples)
    assert max(example_length(examples[i]) for i in grouped.batches[0]) == longest
    assert sorted(i for b in grouped.batches for i in b) == list(range(400))
    assert grouped.batches != build_dataloader(r_grouped, examples, config, epoch=1).batches


def test_skip_batches_resumes_with_the_same_remaining_batches():
    r = recipe("multiple_choice", num_choices=2)
    full = batches(r, epoch=2)
    examples, config = setup(r)
    resumed = build_dataloader(r, examples, config, epoch=2, skip_batches=5)
    assert len(resumed) == len(full) - 5 and resumed.batches_per_epoch == len(full)
    for a, b in zip(full[5:], resumed, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="skip_batches"):
        build_dataloader(r, examples, config, skip_batches=len(full) + 1)


@pytest.mark.parametrize("task", TASKS)
def test_make_batch_has_exactly_the_input_size(task):
    r = recipe(task, num_choices=3, num_labels=5)
    config = model_config(r)
    batch = make_batch(r, config, (12, 37))
    shape = (4, 3, 37) if task == "multiple_choice" else (12, 37)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["token_type_ids"].shape == shape
    assert 0 <= batch["input_ids"].min() and batch["input_ids"].max() < config.vocab_size
    if task == "sequence_classification":
        assert batch["labels"].shape == (12,) and batch["labels"].max() < 5
    if task == "multiple_choice":
        assert batch["labels"].shape == (4,) and batch["labels"].max() < 3
    if task == "question_answering":
        assert (batch["start_positions"] <= batch["end_positions"]).all() and batch["end_positions"].max() < 37
    if task == "causal_lm":
        assert torch.equal(batch["labels"], batch["input_ids"])
    assert torch.equal(make_batch(r, config, (12, 37))["input_ids"], batch["input_ids"])


def test_make_batch_rejects_a_partial_multiple_choice_batch():
    r = recipe("multiple_choice", num_choices=4)
    with pytest.raises(ValueError, match="num_choices"):
        make_batch(r, model_config(r), (6, 10))


def test_max_input_size():
    assert max_input_size(recipe("multiple_choice", batch_size=16, num_choices=4, max_length=128)) == (64, 128)
    assert max_input_size(recipe("question_answering", batch_size=12, max_length=384)) == (12, 384)


def test_max_length_beyond_the_model_positions_is_named():
    r = recipe("sequence_classification", "roberta", max_length=513)
    with pytest.raises(ValueError, match="data.max_length=513"):
        setup(r)


def test_loss_falls_on_synthetic_qqp():
    r = recipe(batch_size=16, num_examples=320, max_length=64)
    r.model.config_overrides = {"num_hidden_layers": 2}
    model = build_model(r)
    examples = build_dataset(r, model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for epoch in range(5):
        for batch in build_dataloader(r, examples, model.config, epoch=epoch):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert len(losses) == 100
    assert sum(losses[:10]) / 10 > 0.6  # chance level, ln 2
    assert sum(losses[-10:]) / 10 < 0.1, losses[::10]
