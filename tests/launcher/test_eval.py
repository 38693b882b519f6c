import io
import json
import math
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

import mimose_cli.launcher.train
from mimose_cli.launcher.data.dataset import build_dataset, build_validation
from mimose_cli.launcher.evaluate import correct, evaluate
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.resume import resume_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.memory import build_meter
from mimose_cli.runs.report import render_run
from mimose_cli.runs.rundir import RunWriter

from helpers import QUICKSTART

# Five small steps of 2 questions x 2 choices, and 8 validation examples evaluated after steps
# 1 and 3 (every 2) and 4 (the last).
SMALL = ["training.max_steps=5", "training.batch_size=2", "data.num_examples=32", "data.num_choices=2",
         "data.max_length=64"]
EVAL = ["data.validation_examples=8", "training.eval_every=2"]
EVALUATED = [1, 3, 4]
SLEEP_S = 1.0  # added to every evaluation of the reference run: it must not show in iter_ms


def _recipe(out, *overrides):
    return load_recipe(QUICKSTART, SMALL + [f"out_dir={out}", *overrides])


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _figures(run_dir):
    """Every step's training loss and evaluation figures, as written."""
    return [(d["step"], d["loss"], d["eval_loss"], d["eval_accuracy"]) for d in _lines(run_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same five steps with evaluation (printed as plain lines; each evaluation made
    ``SLEEP_S`` slower) and without."""
    out = tmp_path_factory.mktemp("runs")
    slow = mimose_cli.launcher.train.evaluate

    def slower(*args, **kwargs):
        time.sleep(SLEEP_S)
        return slow(*args, **kwargs)

    console = Console(file=io.StringIO(), width=200)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mimose_cli.launcher.train, "evaluate", slower)
        evaluated = run_training(_recipe(out, *EVAL), view="plain", console=console)
    plain = run_training(_recipe(out), view="none")
    return SimpleNamespace(evaluated=evaluated, plain=plain, output=console.file.getvalue())


def test_evaluation_every_n_steps_and_after_the_last(runs):
    lines = _lines(runs.evaluated.run_dir)
    assert [d["step"] for d in lines if d["eval_loss"] is not None] == EVALUATED
    budget = runs.evaluated.summary["budget_bytes"]
    for d in lines:
        if d["step"] in EVALUATED:
            assert math.isfinite(d["eval_loss"]) and 0 <= d["eval_accuracy"] <= 1
            assert d["eval_ms"] > 0 and 0 < d["memory/eval_peak_bytes"] <= budget
        else:
            assert (d["eval_accuracy"], d["eval_ms"], d["memory/eval_peak_bytes"]) == (None, None, None)
    last = lines[-1]
    summary = runs.evaluated.summary
    assert (summary["eval_loss"], summary["eval_accuracy"], summary["eval_step"]) == (
        last["eval_loss"], last["eval_accuracy"], 4)
    assert summary["eval_time_s"] >= len(EVALUATED) * 0.001
    assert "eval after step 3: loss " in runs.output and "(8 examples, " in runs.output


def test_evaluation_time_is_not_the_steps(runs):
    evaluated = [r for r in runs.evaluated.records if r.step in EVALUATED]
    assert len(evaluated) == 3 and all(r.iter_ms < SLEEP_S * 1e3 for r in evaluated)


def test_evaluating_leaves_training_bit_for_bit_as_it_was(runs):
    with_eval = [(r.step, r.loss, r.peak_bytes, r.plan) for r in runs.evaluated.records]
    without = [(r.step, r.loss, r.peak_bytes, r.plan) for r in runs.plain.records]
    assert with_eval == without and len({loss for _, loss, _, _ in without}) > 1
    assert runs.plain.summary["eval_loss"] is None
    assert all(d["eval_loss"] is None for d in _lines(runs.plain.run_dir))


def test_the_report_shows_every_evaluation(runs):
    console = Console(file=io.StringIO(), width=200)
    render_run(runs.evaluated.run_dir, console)
    text = console.file.getvalue()
    assert "evaluations on the validation split" in text and "eval loss / accuracy (after step 4)" in text
    shown = [line.split("│")[1].strip() for line in text.split("evaluations on the validation split")[1]
             .split("last steps")[0].splitlines() if line.startswith("│")]
    assert shown == [str(step) for step in EVALUATED]


def test_evaluations_of_earlier_segments_survive_a_resume(runs, tmp_path, monkeypatch):
    """Stopped by SIGTERM after step 3 and resumed: the evaluations after steps 1 and 3 stay, the
    one after step 4 is added, and every figure is the uninterrupted run's."""
    original = RunWriter.metric

    def metric(self, record):
        original(self, record)
        if record.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:
        patch.setattr(RunWriter, "metric", metric)
        stopped = run_training(_recipe(tmp_path, *EVAL), view="none")
    assert stopped.summary["status"] == "interrupted" and stopped.summary["checkpoint_step"] == 4
    resumed = run_training(resume_recipe(stopped.run_dir), view="none", resume=stopped.run_dir)
    assert _figures(stopped.run_dir) == _figures(runs.evaluated.run_dir)
    assert resumed.summary["eval_step"] == 4 and resumed.summary["eval_loss"] == runs.evaluated.summary["eval_loss"]


def test_evaluation_out_of_memory_ends_the_run_with_one_line(tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated device out of memory: tried to allocate 1 MiB\nmore")

    monkeypatch.setattr(mimose_cli.launcher.train, "evaluate", out_of_memory)
    result = run_training(_recipe(tmp_path, "data.validation_examples=4", "training.max_steps=2"), view="none")
    assert result.summary["status"] == "oom" and result.exit_code == 1
    assert result.summary["error"] == ("evaluating on the validation split after step 1 ran out of memory "
                                       "(simulated device out of memory: tried to allocate 1 MiB); raise the budget")
    assert [d["step"] for d in _lines(result.run_dir)] == [0, 1]  # the step trained is recorded


def test_with_gradient_accumulation_evaluation_follows_the_optimizer_step(tmp_path):
    recipe = _recipe(tmp_path, "data.validation_examples=4", "training.eval_every=1", "training.max_steps=2",
                     "training.gradient_accumulation_steps=2")
    lines = _lines(run_training(recipe, view="none").run_dir)
    assert [(d["step"], d["micro_step"]) for d in lines if d["eval_loss"] is not None] == [(0, 1), (1, 1)]


class _Drawing(torch.nn.Module):
    """A model that draws from torch's RNG in every forward and records how it was called."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.calls = []

    def forward(self, input_ids, labels):
        self.calls.append((self.training, torch.is_grad_enabled()))
        noise = torch.rand(())
        loss = self.weight * labels.float().mean() + 0 * noise
        return SimpleNamespace(loss=loss, logits=torch.nn.functional.one_hot(input_ids[:, 0], 3).float())


def test_evaluate_weights_batches_by_examples_and_leaves_the_rng_and_mode_alone():
    model = _Drawing().train()
    batches = [{"input_ids": torch.tensor([[0], [1], [2]]), "labels": torch.tensor([1, 1, 0])},
               {"input_ids": torch.tensor([[2]]), "labels": torch.tensor([5])}]
    meter = build_meter("simulated", None)
    rng = torch.get_rng_state()
    with meter.activate():
        result = evaluate(model, batches, "sequence_classification", device=torch.device("cpu"), meter=meter)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model.calls == [(False, False), (False, False)]
    assert result.loss == pytest.approx((3 * (2 / 3) + 1 * 5) / 4)  # not the mean of the batch means
    assert (result.accuracy, result.examples) == (1 / 4, 4)  # the logits' argmax is the first input id
    with meter.activate():
        assert evaluate(model, batches, "causal_lm", device=torch.device("cpu"), meter=meter).accuracy is None


def test_question_answering_accuracy_needs_start_and_end_right():
    outputs = SimpleNamespace(start_logits=torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]),
                              end_logits=torch.tensor([[0.0, 0.0, 9.0], [0.0, 9.0, 0.0], [0.0, 0.0, 9.0]]))
    batch = {"start_positions": torch.tensor([1, 0, 1]), "end_positions": torch.tensor([2, 0, 2])}
    assert correct("question_answering", outputs, batch).item() == 1  # right, end wrong, start wrong


def test_synthetic_validation_examples_are_new_examples_of_the_same_task(tmp_path):
    recipe = _recipe(tmp_path, "data.validation_examples=16")
    config = model_config(recipe)
    train, validation = build_dataset(recipe, config), build_validation(recipe, config)
    assert len(validation) == 16 and set(validation[0]) == set(train[0])
    assert all(len(choice) <= 64 for e in validation for choice in e["input_ids"])
    assert not [e for e in validation if e in train[:16]]
    assert build_validation(_recipe(tmp_path), config) is None


SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "is the sky blue today",
             "she opened the door slowly", "he picked up the red ball", "they walked to the store"]


def _tokenizer(path):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]").save_pretrained(path)
    return str(path)


def _csv(path, sentences):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("text,label\n" + "".join(f"{s},{i % 2}\n" for i, s in enumerate(sentences)))
    return path


def test_an_hf_validation_split_from_a_local_file_or_a_directory(tmp_path):
    tokenizer = _tokenizer(tmp_path / "tok")
    hf = ["task=sequence_classification", "data.source=hf", f"data.tokenizer={tokenizer}", "data.max_length=16",
          "training.max_steps=2", "training.batch_size=2"]
    train = _csv(tmp_path / "d" / "train.csv", SENTENCES[:4])
    validation = _csv(tmp_path / "d" / "validation.csv", SENTENCES[3:])
    result = run_training(load_recipe(QUICKSTART, hf + [f"data.name={train}", f"data.validation_split={validation}",
                                                        f"out_dir={tmp_path / 'runs'}"]), view="none")
    last = _lines(result.run_dir)[-1]
    assert result.summary["status"] == "completed" and math.isfinite(last["eval_loss"])
    assert last["eval_accuracy"] in (0, 1 / 3, 2 / 3, 1)  # three examples
    recipe = load_recipe(QUICKSTART, hf + [f"data.name={tmp_path / 'd'}", "data.validation_split=validation"])
    examples = build_validation(recipe, model_config(recipe))
    assert [e["label"] for e in examples] == [0, 1, 0]
    assert len(examples[0]["input_ids"]) == 2 + len(SENTENCES[3].split())  # [CLS] text [SEP]
