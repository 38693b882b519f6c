"""What several test modules share: the quickstart recipe cut small, a tiny BERT and its batches.

Test modules import this as ``helpers`` (pyproject's pytest ``pythonpath`` holds ``tests``), never
another test module or a conftest, so a test runs the same from any directory and under any
import mode.
"""

import contextlib
import copy
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# The quickstart recipe, cut to a few small steps so the suite stays fast on 2 cores.
QUICK_OVERRIDES = ["training.max_steps=6", "training.batch_size=4", "data.num_examples=48"]


def assert_tensors_close(reference, actual, what="tensor"):
    """Each tensor of ``actual`` equals its ``reference`` to float32 rounding: within 1e-5 of the
    reference tensor's largest magnitude.

    For steps whose backward graphs differ (a checkpointed block's recomputation against the
    plain graph, on a Hugging Face model): torch fixes neither the order in which the autograd
    engine sums the gradient contributions of a tensor several blocks use (T5's shared position
    bias, tied embeddings) nor, across CPUs, which BLAS kernel a recomputed tensor's layout picks,
    so the last bits may differ (issue: 2e-7 on tiny T5 on an AMD EPYC). A different dropout mask,
    a cache appended twice or a skipped block changes a gradient by far more than this."""
    reference, actual = list(reference), list(actual)
    assert len(reference) == len(actual), what
    for index, (a, b) in enumerate(zip(reference, actual)):
        assert (a is None) == (b is None), f"{what} {index}"
        if a is not None:
            scale = float(a.abs().max()) if a.numel() else 0.0
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * scale + 1e-12, msg=f"{what} {index}")


def tiny_bert(layers=3, seed=0, attention="eager", max_length=128):
    """A BERT of ``layers`` blocks for sequence classification, hidden size 32, dropout on;
    ``attention`` is transformers' ``attn_implementation`` (``sdpa``: torch's fused kernel)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=max_length, attn_implementation=attention)
    return BertForSequenceClassification(config).train()  # dropout 0.1 stays on


def bert_batch(batch_size, length, seed=1):
    """A batch for ``tiny_bert`` of ``batch_size`` x ``length`` tokens, the same for the same size."""
    gen = torch.Generator().manual_seed(seed * 1000 + length)
    return {"input_ids": torch.randint(0, 64, (batch_size, length), generator=gen),
            "labels": torch.randint(0, 2, (batch_size,), generator=gen)}


def sharded_probe_batch():
    """The batch whose eval-mode logits tests/launcher/sharded_ranks.py writes after training (and
    after loading a checkpoint into another number of ranks), for its tests to recompute."""
    return bert_batch(2, 12, seed=99)


def run_step(planner, meter, data, seed=7):
    """One planned forward+backward; returns (loss, measured peak bytes, StepInfo)."""
    for p in planner.model.parameters():
        p.grad = None
    meter.track(data)
    torch.manual_seed(seed)
    with meter.step() as mem:
        with planner.step(data) as info:
            loss = planner.model(**data).loss
            loss.backward()
    return loss.detach(), mem.peak_bytes, info


@contextlib.contextmanager
def fitted_mimose(state, budget="1GB", model=None, **options):
    """A Mimose planner past its sheltered phase: ``state`` (a ``state_dict``, left unchanged)
    loaded into a planner for ``model`` (a fresh ``tiny_bert``) on a simulated device of
    ``budget``. Yields ``(planner, meter)``; the planner is closed and the device off on exit."""
    from mimose_cli.memory import build_meter
    from mimose_cli.planners.mimose.policy import Mimose
    from mimose_cli.units import parse_size

    model = tiny_bert() if model is None else model
    meter = build_meter("simulated", parse_size(budget))
    with meter.activate():
        meter.track(model)
        planner = Mimose(model, budget, meter=meter, **options)
        planner.load_state_dict(copy.deepcopy(state))
        try:
            yield planner, meter
        finally:
            planner.close()


def require_allocator():
    """The allocator meter's extension, built or loaded; the calling test is skipped, with the
    reason, where it cannot be built here."""
    import pytest

    from mimose_cli.memory.allocator import AllocatorUnavailable, load_allocator

    try:
        return load_allocator()
    except AllocatorUnavailable as error:
        pytest.skip(f"the allocator meter cannot be built here: {error}")
