"""mimose_cli.launcher.hf_trainer: a transformers Trainer under a budget with fit_budget, gradient accumulation on.

Every run trains a tiny BERT on the same variable-length batches with the same seed, so losses,
gradient norms and weights compare with a Trainer that has no mimose at all.
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from mimose_cli.launcher.hf_trainer import fit_budget
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.planners.inputs import resized_batch
from mimose_cli.planners.recovery import PlanOutOfMemoryError
from mimose_cli.planners import trial

from helpers import assert_tensors_close, tiny_bert

STEPS, ACCUMULATION, BATCH = 6, 2, 4
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _data(n=32):
    """Rows of 8 to 120 tokens: the longest batches need several times the memory of the shortest."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = int(torch.randint(8, 120, (1,), generator=gen))
        rows.append({"input_ids": torch.randint(0, 64, (length,), generator=gen), "labels": i % 2})
    return rows


def _pad(rows):
    length = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = row["input_ids"]
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": torch.tensor([row["labels"] for row in rows])}


def _trainer(cls=Trainer, steps=STEPS, **overrides):
    args = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=ACCUMULATION, max_steps=steps, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    args.update(overrides)
    return cls(model=tiny_bert(layers=3), args=TrainingArguments(**args), train_dataset=_data(),
               data_collator=_pad)


@dataclass
class Run:
    trainer: Trainer
    infos: list  # planner.last after each micro-batch

    @property
    def steps(self) -> list:
        return [line for line in self.trainer.state.log_history if "loss" in line]

    @property
    def metrics(self) -> dict:
        return self.trainer.state.log_history[-1]


def _train(trainer, budget=None, planner="mimose", **options) -> Run:
    """Train ``trainer`` (under ``budget`` when given), noting the planner's StepInfo per micro-batch."""
    infos = []
    if budget is not None:
        fitted = fit_budget(trainer, budget, planner, **options)
        step = trainer.training_step

        def noted(*args, **kwargs):
            loss = step(*args, **kwargs)
            infos.append(fitted.planner.last)
            return loss

        trainer.training_step = noted
    trainer.train()
    return Run(trainer, infos)


def _same_training(run: Run, plain: Run) -> None:
    """The losses, gradient norms and final weights of the run without mimose: the first loss bit
    for bit (the same forward ops in the same order on the same weights), the rest at float
    tolerance, since checkpointed blocks' gradients may differ in the last bits
    (``helpers.assert_tensors_close`` says why) and later steps start from those weights."""
    losses, plain_losses = ([s["loss"] for s in r.steps] for r in (run, plain))
    assert losses[0] == plain_losses[0]
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert [s["grad_norm"] for s in run.steps] == pytest.approx([s["grad_norm"] for s in plain.steps], rel=1e-5)
    assert_tensors_close(list(plain.trainer.model.parameters()), list(run.trainer.model.parameters()),
                         "parameter")


@pytest.fixture(scope="module")
def plain():
    return _train(_trainer())


@pytest.fixture(scope="module")
def budget():
    """Between what the steps peak at with no block checkpointed and with every block."""
    none = _train(_trainer(), "1GB", "none").metrics["mimose/max_peak_bytes"]
    full = _train(_trainer(), "1GB", "full").metrics["mimose/max_peak_bytes"]
    assert full < none
    return (none + full) // 2


def test_mimose_fits_a_budget_no_checkpointing_cannot(budget, plain):
    run = _train(_trainer(), budget)
    assert run.trainer.state.global_step == STEPS
    assert len(run.infos) == STEPS * ACCUMULATION  # one plan per micro-batch
    assert len(run.steps) == STEPS and all(0 < s["mimose/peak_bytes"] <= budget for s in run.steps)
    assert sum(s["mimose/retries"] for s in run.steps) == 0
    planned = [info for info in run.infos if info.phase == "responsive"]
    longest = max(planned, key=lambda info: info.input_size[-1])
    shortest = min(planned, key=lambda info: info.input_size[-1])
    assert checkpointed(longest.plan) and not checkpointed(shortest.plan)  # just enough: blocks on long batches only
    assert run.metrics["mimose/checkpointed_micro_batches"] < STEPS * ACCUMULATION
    # Planned from the first micro-batch: the probes' estimate, no micro-batch measured.
    assert run.metrics["mimose/measured_micro_batches"] == sum(info.measured for info in run.infos) == 0
    assert run.metrics["mimose/max_peak_bytes"] == max(s["mimose/peak_bytes"] for s in run.steps)
    _same_training(run, plain)


class OutOfMemoryOnce(Trainer):
    """Runs out of memory in the first attempt of micro-batch ``AT`` (the second of an optimizer
    step, gradients of the first pending), as a step whose prediction fell short would: half the
    budget is held through that attempt's forward and backward."""

    AT = 8
    calls = 0
    ballast_bytes = 0

    def compute_loss(self, model, inputs, **kwargs):
        # Mimose's three probe steps (before the first micro-batch) run the Trainer's training
        # step too: only the training micro-batches are counted.
        self.calls += not trial._RUNNING
        self.ballast = torch.empty(self.ballast_bytes, dtype=torch.uint8) if self.calls == self.AT else None
        return super().compute_loss(model, inputs, **kwargs)


# The failed attempt overshot by half the budget: Mimose keeps that margin for the size, and warns.
@pytest.mark.filterwarnings("ignore:input size .* is predicted not to fit")
def test_out_of_memory_is_retried_and_changes_nothing(budget, plain):
    trainer = _trainer(OutOfMemoryOnce)
    trainer.ballast_bytes = budget // 2
    run = _train(trainer, budget)
    assert [info.retries for info in run.infos].count(1) == 1 and run.infos[OutOfMemoryOnce.AT - 1].retries == 1
    assert sum(s["mimose/retries"] for s in run.steps) == 1 and run.metrics["mimose/retries"] == 1
    _same_training(run, plain)  # the subclass's compute_loss ran inside the planner, unchanged


def test_sublinear_by_name_plans_once_for_the_largest_input(budget, plain):
    run = _train(_trainer(), budget, "sublinear", max_input_size=(BATCH, 120))
    plans = {info.plan for info in run.infos}
    assert len(plans) == 1 and checkpointed(*plans)
    assert all(s["mimose/peak_bytes"] <= budget for s in run.steps)
    _same_training(run, plain)


def test_a_step_that_cannot_fit_raises_and_leaves_nothing_on(budget):
    trainer = _trainer()
    fitted = fit_budget(trainer, budget, "none")
    block = fitted.planner.blocks[0][1]
    assert "forward" in vars(block)  # routed while fitted
    with pytest.raises(PlanOutOfMemoryError, match="ran out of memory"):
        trainer.train()
    assert "forward" not in vars(block)  # the planner let go of the model
    torch.empty(2 * budget, dtype=torch.uint8)  # and no simulated device is left on


def test_a_second_train_plans_again():
    trainer = _trainer(steps=1)
    fitted = fit_budget(trainer, "1GB")
    trainer.train()
    first = fitted.planner
    trainer.train()
    assert fitted.planner is not first and fitted.totals.micro_batches == ACCUMULATION
    assert "forward" not in vars(first.blocks[0][1]) and "forward" not in vars(fitted.planner.blocks[0][1])


@pytest.mark.parametrize("setting, budget, kwargs, message", [
    ({}, "6 gigs", {}, "budget='6 gigs': cannot read '6 gigs' as a byte size; write e.g. '6GB'"),
    ({}, "1KB", {}, "budget of 1000 B cannot hold the model's weights and their gradients .*raise it"),
    ({}, "1GB", {"planner": "fast"}, "planner='fast' is unknown; choose one of dtr, full, hf-every-n, mimose"),
    ({}, "1GB", {"sheltered": 3}, "sheltered=3 is not an option of planner='mimose'; its options: bucket, "
                                  "choices, estimate, granularity, prediction_margin, sheltered_steps"),
    ({}, "1GB", {"bucket": "fast"}, "bucket='fast' is invalid for planner='mimose'; expected a valid number"),
    ({}, "1GB", {"planner": "full", "selective": "yes"},
     "selective='yes' is invalid for planner='full'; expected true or false"),
    ({}, "1GB", {"planner": "sublinear"}, "pass max_input_size=\\(batch_size, max_length\\)"),
    ({}, "1GB", {"planner": "hf-every-n"}, "planner='hf-every-n' plans once, for the largest batch"),
    ({}, "1GB", {"planner": "sublinear", "max_input_size": 120},
     r"max_input_size=120 is invalid; expected \(batch_size"),
])
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_refused_in_one_line_naming_the_setting(setting, budget, kwargs, message):
    trainer = _trainer(**setting)
    with pytest.raises(ValueError, match=message) as error:
        fit_budget(trainer, budget, **kwargs)
    assert "\n" not in str(error.value)
    assert "forward" not in vars(trainer.model.bert.encoder.layer[0])  # nothing was routed


def test_fsdp_asked_of_the_trainer_on_the_cpu_is_refused_in_one_line():
    """Under torchrun with use_cpu=True, TrainingArguments(fsdp=True) is accepted but accelerate
    runs no FSDP (``is_fsdp_enabled`` stays False: seen with 2 gloo ranks), so the model would train
    unsharded on every rank. TrainingArguments refuses fsdp in one process, so the argument is set
    on the built Trainer here as torchrun's processes hold it."""
    trainer = _trainer()
    trainer.args.fsdp = ["full_shard"]
    assert not trainer.is_fsdp_enabled
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=...\) on the CPU: accelerate runs no FSDP") as error:
        fit_budget(trainer, "1GB")
    assert "\n" not in str(error.value) and "forward" not in vars(trainer.model.bert.encoder.layer[0])


def test_resized_batch_repeats_rows_and_tokens_keeping_every_key():
    batch = _pad(_data(3))
    big = resized_batch(batch, (5, 300))
    assert big["input_ids"].shape == big["attention_mask"].shape == (5, 300) and big["labels"].shape == (5,)
    length = batch["input_ids"].shape[-1]
    assert torch.equal(big["input_ids"][3, :length], batch["input_ids"][0])
    assert torch.equal(big["labels"], batch["labels"][[0, 1, 2, 0, 1]])
    small = resized_batch(batch, (2, 5))
    assert torch.equal(small["input_ids"], batch["input_ids"][:2, :5])


def test_fit_budget_twice_is_refused():
    trainer = _trainer()
    fit_budget(trainer, "1GB")
    with pytest.raises(ValueError, match="fit_budget was called on this trainer already"):
        fit_budget(trainer, "2GB")


def test_a_keyword_only_code_can_pass_reaches_the_planner():
    def cost(holder):
        return 1.0

    fitted = fit_budget(_trainer(), "1GB", "dtr", cost_fn=cost)
    assert fitted.planner.policy.rematerializer.cost_fn is cost
    fitted.planner.close()


def test_the_trainers_own_checkpointing_is_taken_over_with_one_line(budget, plain, caplog):
    trainer = _trainer(gradient_checkpointing=True)  # TRL's SFTTrainer's default
    trainer.model.activation_checkpointing_enable()
    with caplog.at_level("WARNING", logger="mimose_cli.launcher.hf_trainer"):
        run = _train(trainer, budget)
    said = [r.getMessage() for r in caplog.records if "turned off" in r.getMessage()]
    assert len(said) == 1 and "gradient_checkpointing=True" in said[0] and "model's own" in said[0]
    assert "decides per batch" in said[0]
    assert not trainer.args.gradient_checkpointing and not trainer.model.is_activation_checkpointing
    assert any(checkpointed(info.plan) for info in run.infos) and not all(checkpointed(info.plan) for info in run.infos)  # mimose's plans
    _same_training(run, plain)


class CountingCalls(Trainer):
    """Notes the length of every batch its ``compute_loss`` sees."""

    def compute_loss(self, model, inputs, **kwargs):
        self.lengths.append(inputs["input_ids"].shape[-1])
        return super().compute_loss(model, inputs, **kwargs)


def test_compute_loss_sees_as_many_probe_calls_as_the_docs_say():
    """docs/HF_TRAINER.md: the probes call the Trainer's ``training_step`` three times before the
    first micro-batch (the tiny BERT's stack of 3 is too short to leave layers out)."""
    trainer = _trainer(CountingCalls, steps=1)
    trainer.lengths = []
    _train(trainer, "1GB")
    assert trainer.lengths[:3] == [16, 16, 24] and len(trainer.lengths) == 3 + ACCUMULATION
    said = " ".join((DOCS / "HF_TRAINER.md").read_text().split())
    assert "Mimose's probes call the Trainer's own `training_step` three times" in said


def test_auto_find_batch_size_lowers_the_batch_on_mimoses_out_of_memory():
    """A batch of 8 does not fit the budget even with every block checkpointed, one of 4 does:
    the Trainer's auto_find_batch_size (accelerate's find_executable_batch_size, which looks for
    " out of memory." in the error) lowers the batch instead of ending the run."""
    full = {rows: _train(_trainer(steps=1, per_device_train_batch_size=rows), "1GB", "full")
            .metrics["mimose/max_peak_bytes"] for rows in (4, 8)}
    budget = (full[4] + full[8]) // 2
    run = _train(_trainer(steps=2, per_device_train_batch_size=8, auto_find_batch_size=True), budget)
    assert 4 <= run.trainer._train_batch_size < 8 and run.trainer.state.global_step == 2
    assert all(0 < s["mimose/peak_bytes"] <= budget for s in run.steps)
