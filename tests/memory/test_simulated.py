"""The simulated device counts exactly, enforces its budget and recovers from out-of-memory."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from mimose_cli.memory import SavedBytesCounter, StepMemory, build_meter

# A stack of MLP blocks, Linear(D, H) -> ReLU -> Linear(H, D), whose memory is known by hand.
N, B, D, H = 3, 256, 32, 128
F32 = 4
ACT_D, ACT_H = B * D * F32, B * H * F32  # one (B, D) / (B, H) activation
WEIGHTS = N * 2 * D * H * F32
SCALAR = F32  # the loss, and the ones() its backward starts from


def make_stack():
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(D, H, bias=False), torch.nn.ReLU(), torch.nn.Linear(H, D, bias=False)
        )
        for _ in range(N)
    )


def stack_forward(blocks, x, ckpt):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
    return x.sum()


def expected_stack(ckpt):
    """Hand-derived live bytes after forward, and the peak (in the first block's backward).

    After forward every block input is held (x_0 .. x_{N-1}); without checkpointing each
    ReLU output (saved by ReLU and the second Linear) too. The peak is reached in the last
    block's ReLU backward: grad of its output and of its input (two (B, H)), the second
    weight's grad, the loss and ones(), on top of what forward holds (with checkpointing,
    plus that block's recomputed ReLU output).
    """
    held = WEIGHTS + N * ACT_D + (0 if ckpt else N * ACT_H)
    backward_extra = 2 * ACT_H + D * H * F32 + SCALAR + (ACT_H if ckpt else 0)
    return held + SCALAR, held + SCALAR + backward_extra


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_linear_stack_matches_hand_count(ckpt):
    blocks = make_stack()
    meter = build_meter("simulated")
    with meter.activate():
        meter.track(blocks)
        x = torch.randn(B, D)
        saved = SavedBytesCounter(exclude=blocks.parameters())
        with meter.step() as mem:
            with saved:  # saved-tensor hooks of our own must not disturb the count
                loss = stack_forward(blocks, x, ckpt)
            after_forward = meter.current_bytes()
            loss.backward()
            del loss
    want_after_forward, want_peak = expected_stack(ckpt)
    assert after_forward == want_after_forward
    # What forward leaves alive, less weights and loss, is exactly what it saved for backward.
    assert saved.bytes == after_forward - WEIGHTS - SCALAR
    assert abs(mem.peak_bytes - want_peak) <= 0.01 * want_peak
    # Forward and backward leave the weights, their grads and the input behind.
    assert mem.start_bytes == WEIGHTS + ACT_D
    assert mem.end_bytes == 2 * WEIGHTS + ACT_D


def tiny_bert():
    from transformers import BertConfig, BertForMultipleChoice

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )
    model = BertForMultipleChoice(config).train()
    batch = {
        "input_ids": torch.randint(0, 100, (2, 2, 16)),
        "attention_mask": torch.ones(2, 2, 16, dtype=torch.long),
        "labels": torch.tensor([0, 1]),
    }
    return model, batch


def checkpoint_layers(model):
    """Run every encoder layer through non-reentrant checkpoint."""
    for layer in model.bert.encoder.layer:
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    return lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **kwargs)


def bert_step_against_memtracker(meter, ckpt: bool) -> tuple:
    """One steady AdamW step of the tiny BERT (every layer checkpointed when ``ckpt``) on
    ``meter``, and the same step under torch's MemTracker: ``(StepMemory, MemTracker's peak)``."""
    model, batch = tiny_bert()
    if ckpt:
        checkpoint_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

    def train_step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # the optimizer state exists from here on, as in every later step
    with meter.activate():
        meter.track(model, optimizer, batch)
        with meter.step() as mem:
            train_step()
    reference = MemTracker()
    reference.track_external(model, optimizer, *batch.values())
    with reference:
        train_step()
    return mem, reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.filterwarnings("ignore:Module is None")  # MemTracker's own noise
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_bert_step_matches_memtracker(ckpt):
    mem, want = bert_step_against_memtracker(build_meter("simulated"), ckpt)
    assert abs(mem.peak_bytes - want) <= 0.01 * want
    assert mem.end_bytes == mem.start_bytes  # grads were set to None


def test_budget_below_peak_raises_and_state_recovers():
    blocks = make_stack()
    _, peak = expected_stack(ckpt=False)
    meter = build_meter("simulated", budget_bytes=peak - 1)
    with meter.activate():
        meter.track(blocks)
        x = torch.randn(B, D)
        message = None
        with meter.step() as mem:
            try:
                stack_forward(blocks, x, ckpt=False).backward()
            except torch.OutOfMemoryError as error:
                message = str(error)
        assert message is not None and "simulated device out of memory" in message
        assert "budget of" in message
        assert mem.peak_bytes <= peak - 1  # a failed allocation is not a peak
        # The failed step's tensors are gone, so the count is back where the step began
        # (the grads already accumulated by the failed backward stay, as they would on a GPU).
        grads = sum(p.grad.nbytes for p in blocks.parameters() if p.grad is not None)
        assert meter.current_bytes() == mem.start_bytes + grads
        blocks.zero_grad(set_to_none=True)
        assert meter.current_bytes() == mem.start_bytes
        # Retrying the same batch with checkpointing fits under the same budget.
        with meter.step() as retry:
            stack_forward(blocks, x, ckpt=True).backward()
        assert retry.peak_bytes == expected_stack(ckpt=True)[1]


def test_budget_at_peak_does_not_raise():
    blocks = make_stack()
    _, peak = expected_stack(ckpt=False)
    meter = build_meter("simulated", budget_bytes=peak)
    with meter.activate():
        meter.track(blocks)
        x = torch.randn(B, D)
        with meter.step() as mem:
            stack_forward(blocks, x, ckpt=False).backward()
    assert mem.peak_bytes == peak


def test_oom_in_forward_frees_its_tensors():
    blocks = make_stack()
    meter = build_meter("simulated", budget_bytes=WEIGHTS + 3 * ACT_H)
    with meter.activate():
        meter.track(blocks)
        x = torch.randn(B, D)
        before = meter.current_bytes()
        raised = False
        try:
            stack_forward(blocks, x, ckpt=False)
        except torch.OutOfMemoryError:
            raised = True
        assert raised
        assert meter.current_bytes() == before


def test_track_is_idempotent():
    blocks = make_stack()
    meter = build_meter("simulated")
    meter.track(blocks)
    assert meter.current_bytes() == WEIGHTS
    weight = blocks[0][0].weight
    meter.track(blocks, weight, weight.t(), {"again": [weight.view(-1)]})
    assert meter.current_bytes() == WEIGHTS


def test_grads_and_optimizer_state_are_counted():
    blocks = make_stack()
    optimizer = torch.optim.AdamW(blocks.parameters(), foreach=True)
    meter = build_meter("simulated")
    with meter.activate():
        meter.track(blocks)
        stack_forward(blocks, torch.randn(B, D), ckpt=False).backward()
        assert meter.current_bytes() == 2 * WEIGHTS  # the weights and their grads
        optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert len(state) == 3 * 2 * N  # exp_avg, exp_avg_sq, step per weight
    assert meter.current_bytes() == 2 * WEIGHTS + sum(t.untyped_storage().nbytes() for t in state)


def test_storage_resize_is_followed_and_refused_past_budget():
    meter = build_meter("simulated", budget_bytes=4096)
    with meter.activate():
        tensor = torch.empty(10)
        tensor.untyped_storage().resize_(400)
        assert meter.current_bytes() == 400
        tensor.resize_(200)
        assert meter.current_bytes() == 800
        with pytest.raises(torch.OutOfMemoryError):
            tensor.untyped_storage().resize_(8192)
        assert tensor.untyped_storage().nbytes() == 800
        assert meter.current_bytes() == 800
        del tensor
        assert meter.current_bytes() == 0


def test_pressure_handler_that_frees_avoids_out_of_memory():
    meter = build_meter("simulated", budget_bytes=4096)
    held, calls = [], []

    def handler(need_bytes):
        calls.append((need_bytes, meter.current_bytes()))
        held.clear()

    with meter.activate():
        held.append(torch.empty(512))  # 2 KiB
        meter.set_pressure_handler(handler)
        with meter.step() as mem:
            out = torch.empty(768)  # 3 KiB: 5 KiB live with the held tensor
        # Called once the op's output was counted, asked to free the excess over the budget.
        assert calls == [(1024, 5120)]
        assert meter.current_bytes() == 3072 == mem.peak_bytes  # the peak is sampled after it
        meter.clear_pressure_handler()
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(512)  # 5 KiB again, and no handler any more
        assert meter.current_bytes() == out.nbytes  # the failed allocation was freed
    assert calls == [(1024, 5120)]


def test_pressure_handler_that_frees_nothing_still_raises():
    meter = build_meter("simulated", budget_bytes=4096)
    calls = []
    with meter.activate():
        meter.set_pressure_handler(calls.append)
        keep = torch.empty(512)
        with pytest.raises(torch.OutOfMemoryError, match="simulated device out of memory"):
            torch.empty(768)
        assert calls == [1024]
        assert meter.current_bytes() == keep.nbytes  # the failed allocation was freed
        with pytest.raises(RuntimeError, match="pressure handler already"):
            meter.set_pressure_handler(calls.append)


def test_pressure_handler_is_not_reentered():
    meter = build_meter("simulated", budget_bytes=4096)
    held, scratch, calls = [], [], []

    def handler(need_bytes):
        calls.append(need_bytes)
        scratch.append(torch.empty(256))  # 1 KiB while over the budget: must not call us again
        held.clear()

    with meter.activate():
        held.append(torch.empty(512))
        meter.set_pressure_handler(handler)
        torch.empty(768)  # from an op: the handler runs in __torch_dispatch__, uncounted
        assert calls == [1024] and meter.current_bytes() == 0
        held.append(torch.empty(512))
        scratch.clear()
        storage = torch.empty(0).untyped_storage()
        storage.resize_(3072)  # from a storage resize: the handler's own allocation is counted
        assert calls == [1024, 1024] and meter.current_bytes() == 3072 + 1024 == 4096
        del storage
        assert meter.current_bytes() == 1024  # the resized storage's bytes go with it


def test_cuda_meter_has_no_pressure_handler():
    from mimose_cli.memory import CudaMeter

    meter = CudaMeter(None, torch.device("cuda"))
    assert not meter.supports_pressure_handler
    with pytest.raises(NotImplementedError, match="ahead of time"):
        meter.set_pressure_handler(lambda need_bytes: None)


def test_step_memory_is_filled_in_and_each_steps_peak_is_its_own():
    """``Meter.step`` starts each step's peak window at the live bytes, the host's peak too."""
    meter = build_meter("simulated")
    with meter.activate():
        keep = torch.empty(256)
        with meter.step() as first:
            scratch = torch.empty(1024)
            del scratch
            out = torch.empty(64)
            meter.host_copy(keep.clone)  # let go at once: only the host's peak remembers it
        with meter.step() as second:
            pass
        assert first == StepMemory(start_bytes=1024, peak_bytes=1024 + 4096, end_bytes=1024 + 256,
                                   peak_host_bytes=1024)
        assert (second.peak_bytes, second.peak_host_bytes) == (1024 + 256, 0)  # what is live, not zero
        del keep, out
        assert meter.current_bytes() == 0


def test_build_meter_picks_and_validates():
    assert build_meter("simulated", budget_bytes=123).budget_bytes == 123
    with pytest.raises(ValueError, match="unknown meter"):
        build_meter("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            build_meter("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_meter_reads_the_allocator():
    meter = build_meter("auto", device=torch.device("cuda"))
    with meter.activate(), meter.step() as mem:
        tensor = torch.empty(2**20, device="cuda")
    assert meter.kind == "cuda"
    assert mem.peak_bytes - mem.start_bytes >= tensor.nbytes
    assert mem.reserved_peak_bytes >= mem.peak_bytes


def test_saved_bytes_excludes_parameters_and_dedups_views():
    linear = torch.nn.Linear(D, H, bias=False)
    x = torch.randn(B, D)
    counter = SavedBytesCounter(exclude=linear.parameters())
    with counter:
        y = linear(x)  # saves x and a view of the weight
        z = y.view(-1) * y.view(-1)  # saves two views of one storage
    assert counter.bytes == ACT_D + ACT_H
    del y, z  # and the graph that saved y's storage
    assert counter.live_bytes() == ACT_D  # x is still alive
    counter.reset()
    assert counter.bytes == 0
    with counter:
        checkpoint(lambda t: linear(t).relu(), x, use_reentrant=False)
    # Inside a checkpoint only the region's input is held for backward.
    assert counter.bytes == ACT_D
