"""Offloaded saved tensors: the same step, the device's memory less exactly the offloaded bytes,
the host's counted apart and given back, parameters never copied."""

import contextlib

import pytest
import torch
from torch import nn

from mimose_cli.memory import build_meter
from mimose_cli.memory.offload import OFFLOAD_MIN_BYTES, OffloadHooks, offload_ms, resident_storages

# A stem, N blocks LayerNorm -> Linear(W, H) -> ReLU -> Linear(H, W), and a wide head: memory known by hand.
N, B, T, W, H, V = 3, 4, 16, 32, 64, 512
F32 = 4
assert B * T * F32 < OFFLOAD_MIN_BYTES <= B * T * W * F32  # a norm's statistics stay, activations go
# Each block saves its input and its norm's output (LayerNorm, the first Linear) and the ReLU's
# output (the ReLU and the second Linear: one storage); the statistics are under the floor and the
# weights' transposes are parameters'.
OFFLOADED_PER_BLOCK = 2 * B * T * W * F32 + B * T * H * F32


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(W, W)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(W), nn.Linear(W, H), nn.ReLU(), nn.Linear(H, W))
                                    for _ in range(N))
        self.head = nn.Linear(W, V)

    def forward(self, x, labels, hooks=None):
        x = self.stem(x)
        for block in self.blocks:
            with hooks() if hooks else contextlib.nullcontext():
                x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _step(offload: bool):
    """One step on the simulated device: (model, loss, live bytes after forward, host bytes after
    forward, meter after backward)."""
    model = Stack()
    gen = torch.Generator().manual_seed(1)
    x, labels = torch.randn(B, T, W, generator=gen), torch.randint(0, V, (B, T), generator=gen)
    meter = build_meter("simulated")
    hooks = (lambda: OffloadHooks(resident_storages(model), meter)) if offload else None
    with meter.activate():
        meter.track(model, x, labels)
        meter.reset_peak()
        loss = model(x, labels, hooks)
        live, host = meter.current_bytes(), meter.host_bytes()
        loss.backward()
    return model, loss.detach(), live, host, meter


def test_an_offloaded_step_computes_the_loss_and_gradients_of_a_kept_one_bit_for_bit():
    """Bit for bit: the same ops run in the same order; backward reads byte-exact copies."""
    kept, kept_loss, *_ = _step(offload=False)
    offloaded, loss, *_ = _step(offload=True)
    assert torch.equal(loss, kept_loss)
    for (name, a), b in zip(kept.named_parameters(), offloaded.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_the_device_holds_exactly_the_offloaded_bytes_less_and_the_host_holds_them_until_backward():
    *_, kept_live, kept_host, kept_meter = _step(offload=False)
    *_, live, host, meter = _step(offload=True)
    offloaded = N * OFFLOADED_PER_BLOCK
    assert kept_host == 0 and kept_meter.peak_host_bytes() == 0
    assert host == offloaded and meter.peak_host_bytes() == offloaded
    assert kept_live - live == offloaded
    # The peak is the head's (its logits dwarf a block's bytes), when every block is on the host.
    assert kept_meter.peak_bytes() - meter.peak_bytes() == offloaded
    assert meter.host_bytes() == 0


def test_parameters_and_views_of_them_stay_on_the_device():
    linear = nn.Linear(W, W)  # saves its input and its weight's transpose, a view of a parameter
    x = torch.randn(B * T, W, requires_grad=True)
    meter = build_meter("simulated")
    with meter.activate(), OffloadHooks(resident_storages(linear), meter):
        y = linear(x)
        assert meter.host_bytes() == B * T * W * F32
    y.sum().backward()
    assert meter.host_bytes() == 0


def test_a_host_copy_is_never_the_device_s_and_its_peak_starts_again_with_the_device_s():
    meter = build_meter("simulated")
    with meter.activate():
        device = torch.ones(256)
        with meter.step() as mem:
            host = meter.host_copy(device.clone)
            assert (meter.current_bytes(), meter.host_bytes()) == (1024, 1024)
            host.add_(1)  # written later: still the host's
            assert (meter.current_bytes(), meter.host_bytes()) == (1024, 1024)
            del host
        assert mem.peak_host_bytes == 1024 and mem.peak_bytes == 1024
        assert meter.host_bytes() == 0
        meter.reset_peak()
        assert meter.peak_host_bytes() == 0


def test_the_transfer_time_is_two_copies_at_the_modelled_bandwidth():
    assert offload_ms(10**9) == pytest.approx(80.0)  # 1 GB out and back at 25 GB/s
