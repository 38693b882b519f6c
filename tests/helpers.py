"""What several test modules share: the quickstart recipe cut small, a tiny BERT and its batches.

Test modules import this as ``helpers`` (pyproject's pytest ``pythonpath`` holds ``tests``), never
another test module or a conftest, so a test runs the same from any directory and under any
import mode.
"""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# The quickstart recipe, cut to a few small steps so the suite stays fast on 2 cores.
QUICK_OVERRIDES = ["training.max_steps=6", "training.batch_size=4", "data.num_examples=48"]


def tiny_bert(layers=3, seed=0):
    """A 3-layer BERT for sequence classification, hidden size 32, dropout on."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, attn_implementation="eager")
    return BertForSequenceClassification(config).train()  # dropout 0.1 stays on


def bert_batch(batch_size, length, seed=1):
    """A batch for ``tiny_bert`` of ``batch_size`` x ``length`` tokens, the same for the same size."""
    gen = torch.Generator().manual_seed(seed * 1000 + length)
    return {"input_ids": torch.randint(0, 64, (batch_size, length), generator=gen),
            "labels": torch.randint(0, 2, (batch_size,), generator=gen)}
