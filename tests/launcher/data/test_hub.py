import csv
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader
from mimose_cli.launcher.models import build_model, model_config
from mimose_cli.launcher.recipe import DataConfig, ModelConfig, Recipe, TrainingConfig

SENTENCES = [
    "the cat sat on the mat", "a dog ran in the park", "is the sky blue today",
    "what is the capital of france", "paris is the capital of france", "she opened the door slowly",
    "he picked up the red ball", "they walked to the store", "then it started to rain",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer trained on the test sentences, saved like a hub tokenizer."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                            cls_token="[CLS]", sep_token="[SEP]").save_pretrained(path)
    return str(path)


def recipe(task, name, tokenizer, max_length=32, **data):
    return Recipe(task=task, model=ModelConfig(type="bert"),
                  data=DataConfig(source="hf", name=str(name), tokenizer=tokenizer, max_length=max_length,
                                  num_choices=2, **data),
                  training=TrainingConfig(batch_size=2))


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def train_step(r):
    model = build_model(r)
    examples = build_dataset(r, model.config)
    batch = next(iter(build_dataloader(r, examples, model.config)))
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    return examples, batch


def test_sentence_pair_classification_from_csv(tmp_path, tokenizer_dir):
    rows = [{"q1": a, "q2": b, "same": i % 2} for i, (a, b) in enumerate(zip(SENTENCES, SENTENCES[1:]))]
    r = recipe("sequence_classification", write_csv(tmp_path / "pairs.csv", rows), tokenizer_dir,
               text_fields=["q1", "q2"], label_field="same")
    examples, batch = train_step(r)
    assert [e["label"] for e in examples] == [i % 2 for i in range(len(rows))]
    first = examples[0]
    assert len(first["input_ids"]) == 3 + len(rows[0]["q1"].split()) + len(rows[0]["q2"].split())
    assert first["token_type_ids"][-1] == 1 and first["token_type_ids"][0] == 0
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}


def test_string_labels_are_numbered_and_truncation_applies(tmp_path, tokenizer_dir):
    rows = [{"text": " ".join(SENTENCES), "label": "pos"}, {"text": SENTENCES[0], "label": "neg"}]
    r = recipe("sequence_classification", write_csv(tmp_path / "t.csv", rows), tokenizer_dir, max_length=10)
    examples = build_dataset(r, model_config(r))
    assert [e["label"] for e in examples] == [1, 0]
    assert len(examples[0]["input_ids"]) == 10


def test_causal_lm_from_json_lines(tmp_path, tokenizer_dir):
    path = tmp_path / "lm.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    examples, batch = train_step(recipe("causal_lm", path, tokenizer_dir))
    assert len(examples) == len(SENTENCES)
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


def test_causal_lm_drops_empty_texts_and_says_how_many(tmp_path, tokenizer_dir):
    path = tmp_path / "lm.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in ["", SENTENCES[0], "  \n", SENTENCES[1]]))
    r = recipe("causal_lm", path, tokenizer_dir)
    with pytest.warns(UserWarning, match="dropped 2 of 4 rows whose column 'text' is empty"):
        examples = build_dataset(r, model_config(r))
    assert [len(e["input_ids"]) for e in examples] == [2 + len(SENTENCES[0].split()), 2 + len(SENTENCES[1].split())]


def test_a_tsv_file_is_read_by_its_tabs(tmp_path, tokenizer_dir):
    path = tmp_path / "t.tsv"
    path.write_text("text\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(SENTENCES[:3])))
    r = recipe("sequence_classification", path, tokenizer_dir)
    assert [e["label"] for e in build_dataset(r, model_config(r))] == [0, 1, 0]


def test_num_examples_trains_on_the_first_rows(tmp_path, tokenizer_dir):
    rows = [{"text": s, "label": i % 2} for i, s in enumerate(SENTENCES)]
    path = write_csv(tmp_path / "t.csv", rows)
    first = recipe("sequence_classification", path, tokenizer_dir, num_examples=3)
    assert [e["label"] for e in build_dataset(first, model_config(first))] == [0, 1, 0]
    every = recipe("sequence_classification", path, tokenizer_dir)
    assert every.data.num_examples is None and len(build_dataset(every, model_config(every))) == len(SENTENCES)


def test_swag_layout_multiple_choice(tmp_path, tokenizer_dir):
    rows = [{"sent1": "she opened the door", "sent2": "then", "ending0": "it started to rain",
             "ending1": "he picked up the red ball", "label": 1}] * 3
    r = recipe("multiple_choice", write_csv(tmp_path / "swag.csv", rows), tokenizer_dir)
    examples, batch = train_step(r)
    assert batch["input_ids"].shape[:2] == (2, 2)
    assert [len(ids) for ids in examples[0]["input_ids"]] == [3 + 5 + 4, 3 + 5 + 6]


def test_squad_layout_answer_positions(tmp_path, tokenizer_dir):
    context = "paris is the capital of france"
    rows = [{"question": "what is the capital of france", "context": context,
             "answers": {"text": ["capital of france"], "answer_start": [context.index("capital")]}},
            {"question": "is the sky blue today", "context": " ".join(SENTENCES),
             "answers": {"text": ["rain"], "answer_start": [" ".join(SENTENCES).index("rain")]}}]
    path = tmp_path / "squad.json"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    r = recipe("question_answering", path, tokenizer_dir, max_length=16)
    examples, _ = train_step(r)
    # [CLS] 6 question words [SEP] paris is the capital of france [SEP]: "capital" is token 11.
    assert (examples[0]["start_positions"], examples[0]["end_positions"]) == (11, 13)
    # The second answer lies beyond the truncation, so it points at [CLS] as in Hugging Face's run_qa.
    assert (examples[1]["start_positions"], examples[1]["end_positions"]) == (0, 0)


def test_missing_column_is_named(tmp_path, tokenizer_dir):
    path = write_csv(tmp_path / "t.csv", [{"sentence": "a dog ran", "label": 0}])
    with pytest.raises(ValueError, match="'text'.*sentence"):
        build_dataset(r := recipe("sequence_classification", path, tokenizer_dir), model_config(r))
    with pytest.raises(ValueError, match="'sent1'"):
        build_dataset(r := recipe("multiple_choice", path, tokenizer_dir), model_config(r))


def test_missing_file_and_tokenizer_are_named(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="nope.csv"):
        build_dataset(r := recipe("causal_lm", tmp_path / "nope.csv", tokenizer_dir), model_config(r))
    path = write_csv(tmp_path / "t.csv", [{"text": "a dog ran", "label": 0}])
    with pytest.raises(ValueError, match="data.tokenizer"):
        build_dataset(r := recipe("causal_lm", path, None), model_config(r))


def test_label_out_of_range_is_named(tmp_path, tokenizer_dir):
    path = write_csv(tmp_path / "t.csv", [{"text": "a dog ran", "label": 5}])
    with pytest.raises(ValueError, match="data.num_labels"):
        build_dataset(r := recipe("sequence_classification", path, tokenizer_dir), model_config(r))


def test_tokenizer_larger_than_the_vocabulary_is_named(tmp_path, tokenizer_dir):
    path = write_csv(tmp_path / "t.csv", [{"text": "a dog ran", "label": 0}])
    r = recipe("causal_lm", path, tokenizer_dir)
    r.model.config_overrides = {"vocab_size": 8}
    with pytest.raises(ValueError, match="vocab_size"):
        build_dataset(r, model_config(r))


def test_text_labels_are_numbered_once_for_every_split(tmp_path, tokenizer_dir):
    from mimose_cli.launcher.data.dataset import build_validation

    train = write_csv(tmp_path / "train.csv", [{"text": s, "label": label}
                                               for s, label in zip(SENTENCES, ["pos", "neg", "pos", "neg"])])
    only_pos = write_csv(tmp_path / "val.csv", [{"text": SENTENCES[0], "label": "pos"}])
    r = recipe("sequence_classification", train, tokenizer_dir, validation_split=str(only_pos))
    assert [e["label"] for e in build_validation(r, model_config(r))] == [1]  # pos, as in training
    unseen = write_csv(tmp_path / "unseen.csv", [{"text": SENTENCES[0], "label": "neutral"}])
    r = recipe("sequence_classification", train, tokenizer_dir, validation_split=str(unseen))
    with pytest.raises(ValueError, match="validation label 'neutral' does not occur in the training split "
                                         r"\(its labels: neg, pos\)"):
        build_validation(r, model_config(r))
