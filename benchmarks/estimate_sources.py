"""Where could Mimose's estimate come from before step 0, and at what cost? (issue: Plan from the
first step)

For each tiny model of the robustness matrix (4 blocks, hidden 64), at one input size, on the
simulated device and one thread, the median time of:

- ``plain``: an ordinary step (no block checkpointed), the unit every cost is counted in;
- ``sheltered``: one step of today's sheltered phase (every block run twice through the
  shuttling collector, every block checkpointed, the per-op live-bytes probe on);
- ``fake``: the same sheltered step on a copy of the model whose weights and inputs are
  ``FakeTensor``s (``torch._subclasses.FakeTensorMode``: no memory, no compute, Python per op),
  i.e. one sample of the estimator's without touching the device.

and whether the fake step's sample agrees with the real one: every per-block and step quantity's
largest value (the peaks the timeline is built from), the largest difference (fake - real) in
percent of the step's largest peak (``fake_vs_real_pct``, and which quantity), or the one-line
reason the fake trace failed (data-dependent Python on tensor values). A row is one model, with the model's default
attention implementation and with ``eager``. Writes benchmarks/results/estimate_sources.json.

    python benchmarks/estimate_sources.py [--models bert,gpt2] [--repeats 3]
"""

import argparse
import copy
import statistics
import time

import numpy as np
import torch
from robustness import MODELS, Shape, build_model, make_batch
from torch._subclasses.fake_tensor import FakeTensorMode

from mimose_cli.memory import build_meter
from mimose_cli.planners.base import build_planner
from mimose_cli.planners.mimose.policy import Mimose

from _results import write_results

LENGTH = 96


def _shape(spec) -> Shape:
    if spec.kind == "image":
        return Shape(lengths=(32,) * 4, padded=32)  # the model's own image size
    if spec.kind == "seq2seq":
        return Shape(lengths=(LENGTH,) * 4, padded=LENGTH, targets=(32,) * 4, targets_padded=32)
    return Shape(lengths=(LENGTH,) * 4, padded=LENGTH)


def _step(planner, model, batch) -> None:
    for p in model.parameters():
        p.grad = None
    with planner.step(batch):
        out = model(**batch)
        (out.loss if getattr(out, "loss", None) is not None else out.logits.float().sum()).backward()


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def _fake_copy(model, batch, mode: FakeTensorMode):
    fake = copy.deepcopy(model)
    for module in fake.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(mode.from_tensor(param.detach()),
                                                     requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module._buffers[name] = mode.from_tensor(buffer)
    inputs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return fake, inputs


def _largest(sample) -> dict:
    blocks, step = sample[0], sample[1]
    values = {f"{q}[{i}]": float(v.max()) for q, per in blocks.items() if q != "fwd_ms"
              for i, v in enumerate(per) if v is not None and len(v)}
    values.update({q: float(v.max()) for q, v in step.items() if v is not None and len(v)})
    return values


def measure(name: str, attn: str | None, repeats: int) -> dict:
    spec = MODELS[name]
    if attn is not None:
        spec = type(spec)(spec.cls, spec.kind, {**spec.config, "attn_implementation": attn})
    model = build_model(spec).train()
    batch = make_batch(spec, _shape(spec), 0)
    row = {"model": name, "attn": attn or "default", "input_shape": {k: list(v.shape) for k, v in batch.items()
                                                                     if isinstance(v, torch.Tensor)}}
    meter = build_meter("simulated", 10**10)
    with meter.activate():
        meter.track(model)
        plain = build_planner("none", model, None, meter=meter)
        row["plain_ms"] = _median_ms(lambda: _step(plain, model, batch), repeats)
        plain.close()
        real = Mimose(model, "10GB", meter=meter, sheltered_steps=10**6)
        row["sheltered_ms"] = _median_ms(lambda: _step(real, model, batch), repeats)
        real_sample = real.policy.estimator.samples[-1]
        real.close()
    mode = FakeTensorMode()
    fake_model, fake_batch = _fake_copy(model, batch, mode)
    fake = Mimose(fake_model, "10GB", sheltered_steps=10**6)
    try:
        with mode:
            row["fake_ms"] = _median_ms(lambda: _step(fake, fake_model, fake_batch), repeats)
        a, b = _largest(real_sample), _largest(fake.policy.estimator.samples[-1])
        # Relative to the step's largest peak: a quantity of a few bytes off by a few is no error.
        scale = max(a.values())
        diffs = {k: (b.get(k, 0.0) - a.get(k, 0.0)) / scale * 100 for k in set(a) | set(b)}
        worst = max(diffs, key=lambda k: abs(diffs[k]))
        row["fake_vs_real_pct"], row["worst_quantity"] = diffs[worst], worst
        row["quantities_compared"] = len(diffs)
        row["fake_error"] = None
    except Exception as error:  # what the fake trace cannot run is the finding
        row["fake_ms"] = row["fake_vs_real_pct"] = row["worst_quantity"] = None
        row["fake_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    finally:
        fake.close()
    row["sheltered_in_plain"] = row["sheltered_ms"] / row["plain_ms"]
    row["fake_in_plain"] = None if row["fake_ms"] is None else row["fake_ms"] / row["plain_ms"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,roberta,xlnet,gpt2,llama,t5-nocache,vit")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    np.seterr(all="ignore")
    rows = []
    print(f"{'model':11} {'attn':8} {'plain ms':>8} {'sheltered':>9} {'fake':>7} {'fake-real %':>11}  worst / fake trace")
    for name in args.models.split(","):
        for attn in (None, "eager"):
            row = measure(name, attn, args.repeats)
            rows.append(row)
            fake = "-" if row["fake_in_plain"] is None else f"{row['fake_in_plain']:6.2f}x"
            agree = "-" if row["fake_vs_real_pct"] is None else f"{row['fake_vs_real_pct']:+.2f}"
            print(f"{name:11} {row['attn']:8} {row['plain_ms']:8.1f} {row['sheltered_in_plain']:8.2f}x {fake:>7} "
                  f"{agree:>11}  {row['fake_error'] or row['worst_quantity']}", flush=True)
    write_results("estimate_sources", rows, length=LENGTH, repeats=args.repeats, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
