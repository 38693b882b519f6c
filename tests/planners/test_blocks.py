"""How a block runs under every planner: what it is given, what it may change."""

import pytest
import torch
from torch import nn

import mimose_cli
from mimose_cli.planners import build_planner

from helpers import assert_tensors_close

PLANNED = ["full", "mimose"]  # mimose: its first step, sheltered (every block runs twice)
PLAIN_RUNS = [*PLANNED, "offload"]  # offload runs each block once, as it is, its saved tensors copied


def make_planner(name, model):
    """Mimose in its sheltered phase (the step measured: every block run twice and checkpointed,
    the strictest test of computing what a plain step computes)."""
    if name == "mimose":
        return mimose_cli.Mimose(model, budget="1GB", estimate="sheltered")
    return build_planner(name, model)


def planned_step(name, model, batch, seed=3):
    """One forward+backward of ``model`` on ``batch`` (a dict or a tensor): with no planner when
    ``name`` is None, else under a fresh planner ``name``. Returns the loss."""
    planner = None if name is None else make_planner(name, model)
    size = None if isinstance(batch, dict) else tuple(batch.shape)
    torch.manual_seed(seed)
    try:
        if planner is None:
            return _loss(model, batch)
        with planner.step(batch, input_size=size) as info:
            loss = _loss(model, batch)
        assert name != "mimose" or info.phase == "sheltered"
        return loss
    finally:
        if planner is not None:
            planner.close()


def _loss(model, batch):
    loss = model(**batch).loss if isinstance(batch, dict) else model(batch)
    loss.backward()
    return loss.detach()


def assert_same_step(name, make_model, batch, exact=True):
    """A step under planner ``name`` computes the loss and gradients of a plain step. Returns the
    two models after their step (plain, planned).

    The loss is compared bit for bit: the planned forward runs the same ops in the same order on
    the same inputs and dropout masks (checkpointed blocks run theirs under ``no_grad``), which
    gives the same floats on any CPU. With ``exact`` the gradients are too, for the small stacks
    here: each block's input feeds only that block and no tensor is shared between blocks, so the
    recomputed forward and the backward run the same kernels on the same values and sum each
    gradient in the same order as the plain step's. A Hugging Face model passes ``exact=False``:
    its gradients are compared at float tolerance (``helpers.assert_tensors_close`` says why)."""
    plain, planned = make_model(), make_model()
    reference = planned_step(None, plain, batch)
    loss = planned_step(name, planned, batch)
    assert torch.equal(loss, reference)
    grads = [(key, p.grad, q.grad) for (key, p), q in zip(plain.named_parameters(), planned.parameters())]
    if exact:
        for key, a, b in grads:
            assert (a is None) == (b is None), key
            assert a is None or torch.equal(a, b), key
    else:
        assert_tensors_close([a for _, a, _ in grads], [b for _, _, b in grads], "gradient")
    return plain, planned


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16,
                      vocab_size=100, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config).train()  # dropout 0.1 stays on


@pytest.mark.parametrize("name", PLAIN_RUNS)
def test_t5_decoder_blocks_run_without_their_cache_and_match_a_plain_step(name):
    # The decoder keeps its own config (use_cache=True) and hands each block a cache that a
    # second run or a recompute would append to again.
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 100, (2, 9), generator=gen),
             "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3]),
             "labels": torch.randint(1, 100, (2, 5), generator=gen)}
    assert_same_step(name, tiny_t5, batch, exact=False)


class NormStack(nn.Module):
    """Blocks with BatchNorm: running statistics and ``num_batches_tracked`` are buffers."""

    def __init__(self, width=8, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width),
                                                    nn.ReLU()) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x))).sum()


@pytest.mark.parametrize("name", ["none", *PLANNED])
def test_buffers_advance_once_per_step_as_in_a_plain_step(name):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    plain, planned = assert_same_step(name, NormStack, x)
    buffers = dict(planned.named_buffers())
    assert buffers["blocks.0.1.num_batches_tracked"] == 1
    for key, value in plain.named_buffers():
        assert torch.equal(buffers[key], value), key


class BumpBlock(nn.Module):
    """Adds one to its input in place, then a linear layer (which keeps the bumped input)."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        x.add_(1.0)
        return self.linear(x)


class BumpStack(nn.Module):
    def __init__(self, width=8, depth=3, frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(BumpBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        if frozen:  # only the head trains: no block is recomputed
            self.embed.requires_grad_(False)
            self.blocks.requires_grad_(False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).sum()


def forward_then_backward(name, model, x):
    """``(loss, error message or None)`` of a step under planner ``name``."""
    planner = make_planner(name, model)
    loss = None
    try:
        with planner.step(input_size=tuple(x.shape)):
            loss = model(x)
            loss.backward()
    except RuntimeError as error:
        return loss.detach(), str(error)
    finally:
        planner.close()
    return loss.detach(), None


@pytest.mark.parametrize("name", PLANNED)
def test_frozen_blocks_that_modify_their_input_in_place_match_a_plain_step(name):
    # The sheltered phase runs each block twice: the run the step keeps must see the input as
    # the plain step's block does, not modified once already.
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    assert_same_step(name, lambda: BumpStack(frozen=True), x)


def test_a_block_recomputed_after_modifying_its_input_fails_under_mimose_as_under_full():
    # torch's checkpoint recomputes a block from its inputs, which must be unchanged: a block
    # that modified one in place cannot be checkpointed (autograd's version check says so in
    # backward). The sheltered step computes the plain forward and fails as full does.
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    runs = {name: forward_then_backward(name, BumpStack(), x) for name in ["none", *PLANNED]}
    (loss, error), full, sheltered = runs["none"], runs["full"], runs["mimose"]
    assert error is None and torch.equal(full[0], loss) and torch.equal(sheltered[0], loss)
    assert "modified by an inplace operation" in full[1] and sheltered[1] == full[1]


def tiny_resnet():
    """A bottleneck ResNet from its config whose stages hold 2, 3, 6 and 2 layers."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[2, 3, 6, 2],
                          layer_type="bottleneck", num_labels=4)
    return ResNetForImageClassification(config).train()


def test_blocks_are_every_stage_s_layers_not_only_the_longest_stage_s():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    blocks = mimose_cli.planners.blocks.discover_blocks(tiny_resnet())
    assert [n for n, _ in blocks] == [f"resnet.encoder.stages.{s}.layers.{i}"
                                      for s, depth in enumerate([2, 3, 6, 2]) for i in range(depth)]
    assert {type(m).__name__ for _, m in blocks} == {"ResNetBottleNeckLayer"}
    convnext = ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[8, 16, 16, 32], depths=[3, 1, 4, 2]))
    blocks = mimose_cli.planners.blocks.discover_blocks(convnext)
    assert len(blocks) == 10 and {type(m).__name__ for _, m in blocks} == {"ConvNextLayer"}
    assert blocks[3][0] == "convnext.encoder.stages.1.layers.0"  # a stage of one layer counts too


def test_several_globs_name_the_blocks_of_each_in_forward_order():
    model = NormStack()
    blocks = mimose_cli.planners.blocks.discover_blocks(model, ["blocks.2", "blocks.0"])
    assert [n for n, _ in blocks] == ["blocks.0", "blocks.2"]
    with pytest.raises(ValueError, match="blocks='nothing.*' .* matches no module"):
        mimose_cli.planners.blocks.discover_blocks(model, ["blocks.0", "nothing.*"])


@pytest.mark.parametrize("name", PLAIN_RUNS)
def test_a_resnet_step_computes_what_a_plain_step_does(name):
    """Every bottleneck (BatchNorm inside, the statistics advancing once) checkpointed or measured."""
    images = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
              "labels": torch.tensor([0, 3])}
    plain, planned = assert_same_step(name, tiny_resnet, images, exact=False)
    for (key, a), b in zip(plain.named_buffers(), planned.buffers()):
        assert torch.equal(a, b), key


class _Layer(nn.Module):
    """A stack's layer holding lists of its own: projections always, experts in some layers."""

    def __init__(self, experts: int):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(experts))


class _Stack(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.h = nn.ModuleList(_Layer(n) for n in experts)
        self.alias = nn.ModuleList(self.h[:2])  # the same layers held twice


@pytest.mark.parametrize("experts", [[0, 0, 0, 0], [0, 8, 0, 8], [4, 4, 4, 4], [0, 2, 0, 2, 0, 2]])
def test_what_every_layer_or_only_some_hold_is_part_of_the_layer_not_a_block(experts):
    """The layers are the blocks, each once, however many projections or experts (in every layer
    or every other one) outnumber them."""
    blocks = mimose_cli.planners.blocks.discover_blocks(_Stack(experts))
    assert [n for n, _ in blocks] == [f"h.{i}" for i in range(len(experts))]
