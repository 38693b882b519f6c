"""Train a Hugging Face model with transformers' Trainer under a memory budget.

Copy this script and keep the two lines marked `# mimose`: everything else is an ordinary
Trainer run. Here a tiny BERT (built from a config: random weights, nothing downloaded) learns a
synthetic sentence-classification task whose lengths vary like real text, on the CPU, where
mimose simulates a device of exactly the budget (docs/HF_TRAINER.md). On a GPU, drop
use_cpu=True and give the GPU budget you want, e.g. "6GB".

    python3 examples/hf_trainer.py            # about 8 s on one CPU core, imports included
"""

import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from mimose_cli import fit_budget  # mimose

# Without checkpointing the longest batch peaks at 42.6 MB, with every block checkpointed at 14.5 MB:
# at 25 MB short batches train as usual and long ones checkpoint just enough blocks to fit.
BUDGET = "25MB"
VOCAB, NUM_LABELS, MAX_LENGTH = 1000, 2, 128


def synthetic_data(n: int, seed: int = 0) -> list:
    """``n`` token sequences, lengths lognormal (mean ~45, a long right tail), each holding its
    label's token: a task the model can learn."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(40), 0.5, n), 8, MAX_LENGTH).astype(int)
    rows = []
    for length in lengths:
        label = int(rng.integers(NUM_LABELS))
        ids = rng.integers(10, VOCAB, length)
        ids[0], ids[rng.integers(1, length)] = 1, 2 + label  # [CLS], and the label's token
        rows.append({"input_ids": ids.tolist(), "labels": label})
    return rows


def pad(rows: list) -> dict:
    """Pad a batch to its longest row: every batch has its own length."""
    length = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([row["labels"] for row in rows])}


def main(out_dir: str) -> None:
    # A model this small gains nothing from a second CPU thread, and on a machine busy with other
    # work the threads of one op wait on each other (48 s instead of 8 s on ours); not needed on a GPU.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=MAX_LENGTH, num_labels=NUM_LABELS)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, max_steps=8, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                             use_cpu=True, seed=0)  # use_cpu: the simulated device; drop it on a GPU
    trainer = Trainer(model=model, args=args, train_dataset=synthetic_data(256), data_collator=pad)
    fit_budget(trainer, BUDGET)  # mimose: checkpoint just enough blocks per micro-batch to fit
    metrics = trainer.train().metrics
    print(f"mimose: {metrics['mimose/micro_batches']} micro-batches, "
          f"{metrics['mimose/checkpointed_micro_batches']} with blocks checkpointed "
          f"({metrics['mimose/measured_micro_batches']} of them while measuring), "
          f"{metrics['mimose/retries']} retries; peak {metrics['mimose/max_peak_bytes'] / 1e6:.1f} MB "
          f"of the {metrics['mimose/budget_bytes'] / 1e6:.1f} MB budget")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        main(out)
