"""Batches: seeded example order, dynamic padding, resume offsets, and synthetic planner batches.

Every batch is padded to its own longest example (as Hugging Face's ``DataCollatorWithPadding``),
so the padded length L varies from batch to batch: that variation is what Mimose plans for.
"""

import torch

from mimose_cli.launcher.data.synthetic import TokenSpace, data_rng, image_pixels

MEGABATCH_MULT = 50
"""group_by_length sorts megabatches of up to this many batches (Hugging Face Trainer's value)."""


def example_length(example: dict) -> int:
    """Tokens in an example; for multiple choice, its longest choice; an image's side."""
    if "side" in example:
        return example["side"]
    ids = example["input_ids"]
    return max(len(choice) for choice in ids) if ids and isinstance(ids[0], list) else len(ids)


def uses_token_types(config) -> bool:
    """BERT-like models embed the segment id; RoBERTa (type_vocab_size 1) and gpt2 do not."""
    return getattr(config, "type_vocab_size", 0) > 1


def padding_side(config) -> str:
    """XLNet reads its summary from the last position, so its tokenizer pads on the left."""
    return "left" if config.model_type == "xlnet" else "right"


def _pad(rows: list, length: int, value: int, side: str) -> list:
    return [[value] * (length - len(r)) + r if side == "left" else r + [value] * (length - len(r)) for r in rows]


def model_input(batch: dict) -> torch.Tensor:
    """The batch's main input: its token ids, or its images' pixels."""
    return batch["input_ids"] if "input_ids" in batch else batch["pixel_values"]


class Collator:
    """Pads a list of examples into one batch of tensors in the Hugging Face format for the task:
    token rows to the longest (``attention_mask`` marks the padding), images to the largest side
    (zeros at the bottom and right, as a padding collator for images does)."""

    def __init__(self, task: str, config):
        self.task = task
        self.pad_id = getattr(config, "pad_token_id", None)
        self.token_types = uses_token_types(config)
        self.side = padding_side(config)
        self.channels = getattr(config, "num_channels", 3)
        self.num_labels = getattr(config, "num_labels", 2)

    def _images(self, examples: list) -> dict:
        side = max(e["side"] for e in examples)
        pixels = torch.zeros(len(examples), self.channels, side, side)
        for row, example in enumerate(examples):
            image = torch.from_numpy(image_pixels(example, self.channels, self.num_labels))
            pixels[row, :, :example["side"], :example["side"]] = image
        return {"pixel_values": pixels, "labels": torch.tensor([e["label"] for e in examples], dtype=torch.long)}

    def __call__(self, examples: list) -> dict:
        if self.task == "image_classification":
            return self._images(examples)
        multiple_choice = self.task == "multiple_choice"
        rows = [r for e in examples for r in (e["input_ids"] if multiple_choice else [e["input_ids"]])]
        length = max(len(r) for r in rows)
        batch = {
            "input_ids": _pad(rows, length, self.pad_id, self.side),
            "attention_mask": _pad([[1] * len(r) for r in rows], length, 0, self.side),
        }
        if self.token_types:
            types = [r for e in examples for r in (e["token_type_ids"] if multiple_choice else [e["token_type_ids"]])]
            batch["token_type_ids"] = _pad(types, length, 0, self.side)
        batch = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
        if multiple_choice:
            batch = {k: v.view(len(examples), -1, length) for k, v in batch.items()}
        batch.update(self._targets(examples, batch, length))
        return batch

    def _targets(self, examples: list, batch: dict, length: int) -> dict:
        if self.task in ("sequence_classification", "multiple_choice"):
            return {"labels": torch.tensor([e["label"] for e in examples], dtype=torch.long)}
        if self.task == "question_answering":
            shift = [length - len(e["input_ids"]) if self.side == "left" else 0 for e in examples]
            return {key: torch.tensor([e[key] + s for e, s in zip(examples, shift)], dtype=torch.long)
                    for key in ("start_positions", "end_positions")}
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return {"labels": labels}


def length_grouped_order(lengths: list, batch_size: int, rng) -> list:
    """Hugging Face Trainer's length-grouped order: shuffle, sort megabatches by length (longest
    first), and put the longest example in the first batch so memory peaks show up at once."""
    order = rng.permutation(len(lengths)).tolist() if rng is not None else list(range(len(lengths)))
    size = max(1, min(len(lengths) // (batch_size * 4), MEGABATCH_MULT)) * batch_size
    megabatches = [sorted(order[i:i + size], key=lambda j: -lengths[j]) for i in range(0, len(order), size)]
    longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [i for megabatch in megabatches for i in megabatch]


def epoch_batches(lengths: list, batch_size: int, seed: int, epoch: int, shuffle: bool,
                  group_by_length: bool) -> list:
    """The example indices of each batch of one epoch; the last batch may be smaller."""
    rng = data_rng(seed, 1, epoch) if shuffle else None
    if group_by_length:
        order = length_grouped_order(lengths, batch_size, rng)
    else:
        order = rng.permutation(len(lengths)).tolist() if rng is not None else list(range(len(lengths)))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


class BatchLoader:
    """One epoch of batches, in a fixed order given (seed, epoch), from batch ``skip_batches`` on.

    ``len()`` is the number of batches this loader yields; ``batches_per_epoch`` the full count.
    """

    def __init__(self, dataset, batches: list, collate, epoch: int = 0, skip_batches: int = 0):
        if not 0 <= skip_batches <= len(batches):
            raise ValueError(f"skip_batches={skip_batches}: expected 0..{len(batches)} (batches per epoch)")
        self.dataset = dataset
        self.batches = batches
        self.collate = collate
        self.epoch = epoch
        self.skip_batches = skip_batches
        self.batches_per_epoch = len(batches)

    def __len__(self) -> int:
        return self.batches_per_epoch - self.skip_batches

    def __iter__(self):
        for indices in self.batches[self.skip_batches:]:
            yield self.collate([self.dataset[i] for i in indices])


def build_dataloader(recipe, dataset, config, epoch: int = 0, skip_batches: int = 0,
                     world_size: int = 1) -> BatchLoader:
    """The batches of ``epoch``; the same (seed, epoch) gives the same batches in the same order.
    With ``world_size`` processes these are global batches of ``training.batch_size`` examples per
    process, padded together, which each process slices (``distributed.local_batch``); a last
    batch with fewer examples than processes is left out (a process would get none)."""
    data = recipe.data
    lengths = [example_length(e) for e in dataset]
    batches = epoch_batches(lengths, recipe.training.batch_size * world_size, recipe.seed, epoch,
                            data.shuffle, data.group_by_length)
    if batches and len(batches[-1]) < world_size:
        batches.pop()
    return BatchLoader(dataset, batches, Collator(recipe.task, config), epoch, skip_batches)


def build_eval_loader(recipe, dataset, config) -> BatchLoader:
    """The validation batches: ``training.batch_size`` examples each, in the data set's order."""
    size = recipe.training.batch_size
    batches = [list(range(i, min(i + size, len(dataset)))) for i in range(0, len(dataset), size)]
    return BatchLoader(dataset, batches, Collator(recipe.task, config))


def max_input_size(recipe) -> tuple:
    """The largest planner input size (B_eff, L) the recipe allows; B_eff counts every choice;
    (B, H, W) for images, the largest side a multiple of ``data.image_multiple``."""
    batch = recipe.training.batch_size
    if recipe.task == "image_classification":
        multiple = recipe.data.image_multiple
        side = max(multiple, recipe.data.max_length // multiple * multiple)
        return batch, side, side
    if recipe.task == "multiple_choice":
        batch *= recipe.data.num_choices
    return batch, recipe.data.max_length


def make_batch(recipe, config, input_size) -> dict:
    """A random batch of exactly ``input_size`` = (B_eff, L), valid labels, for profiling planners.

    For multiple choice B_eff = B * num_choices and input_ids has shape (B, num_choices, L).
    For images ``input_size`` = (B, H, W).
    """
    if recipe.task == "image_classification":
        rows, height, width = (int(n) for n in input_size)
        rng = data_rng(recipe.seed, 2, rows, height, width)
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.from_numpy(rng.standard_normal((rows, channels, height, width), dtype="float32")),
                "labels": torch.from_numpy(rng.integers(0, recipe.data.num_labels, rows)).long()}
    batch_eff, length = (int(n) for n in input_size)
    shape = (batch_eff, length)
    if recipe.task == "multiple_choice":
        choices = recipe.data.num_choices
        if batch_eff % choices:
            raise ValueError(f"input size {tuple(input_size)}: B_eff must be a multiple of data.num_choices={choices}")
        shape = (batch_eff // choices, choices, length)
    rng = data_rng(recipe.seed, 2, batch_eff, length)
    content = TokenSpace.for_config(config).content
    batch = {
        "input_ids": torch.from_numpy(content[rng.integers(0, len(content), shape)]).long(),
        "attention_mask": torch.ones(shape, dtype=torch.long),
    }
    if uses_token_types(config):
        batch["token_type_ids"] = (torch.arange(length) >= length // 2).long().expand(shape).contiguous()
    rows = shape[0]
    if recipe.task == "sequence_classification":
        batch["labels"] = torch.from_numpy(rng.integers(0, recipe.data.num_labels, rows)).long()
    elif recipe.task == "multiple_choice":
        batch["labels"] = torch.from_numpy(rng.integers(0, shape[1], rows)).long()
    elif recipe.task == "question_answering":
        start = rng.integers(0, length, rows)
        batch["start_positions"] = torch.from_numpy(start).long()
        batch["end_positions"] = torch.from_numpy(rng.integers(start, length)).long()
    else:
        batch["labels"] = batch["input_ids"].clone()
    return batch
