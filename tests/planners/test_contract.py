"""The planner contract (docs/DESIGN.md): the example planner runs, and every planner fits it."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mimose_cli.memory import build_meter
from mimose_cli.planners import PLANNERS, Planner, Policy, build_planner
from mimose_cli.planners.blocks import checkpointed

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"


def _example_source() -> str:
    text = DESIGN.read_text()
    marker = text.index("<!-- example planner")
    return re.search(r"```python\n(.*?)```", text[marker:], re.S).group(1)


@pytest.fixture
def example_planner():
    """The docs' example, executed as written; its registration is undone afterwards."""
    namespace = {}
    exec(compile(_example_source(), str(DESIGN), "exec"), namespace)
    yield namespace["Cautious"]
    PLANNERS.pop("cautious", None)


def test_the_documented_example_is_short():
    assert len(_example_source().strip().splitlines()) <= 30


def _model(width=32, depth=4):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))


def _step(model, planner, length):
    x = torch.randn(8, length, 32, requires_grad=True)
    return planner.run(lambda batch: model(batch).sum().backward(), x, input_size=(8, length))


def _none_peak(model, length=64) -> int:
    """The step's peak at ``length`` with nothing checkpointed (weights included)."""
    meter = build_meter("auto", None)  # the kind a planner builds for itself
    with meter.activate():
        meter.track(model)
        probe = build_planner("none", model, None, meter=meter, blocks="*")
        _step(model, probe, length)
        probe.close()
        for p in model.parameters():
            p.grad = None
        return meter.peak_bytes()


def test_the_example_planner_learns_to_fit_through_the_contract(example_planner):
    model = _model()
    none_peak = _none_peak(model)
    meter = build_meter("auto", int(none_peak * 1.05))
    with meter.activate():
        meter.track(model)
        planner = build_planner("cautious", model, meter.budget_bytes, meter=meter, blocks="*")
        plans, peaks = [], []
        for _ in range(6):
            meter.reset_peak()
            _step(model, planner, 64)
            plans.append(checkpointed(planner.last.plan))
            peaks.append(meter.peak_bytes())
            for p in model.parameters():
                p.grad = None
        _step(model, planner, 16)  # another length starts from nothing
        short = checkpointed(planner.last.plan)
        planner.close()
    limit = planner.limit_bytes
    assert plans[0] == () and plans[1] == (0,)  # learned from the first step's peak
    for plan, peak, following in zip(plans, peaks, plans[1:]):
        grew = peak > 0.9 * limit and len(plan) < planner.num_blocks
        assert len(following) == len(plan) + grew  # observe saw each step's own peak
    assert all(peak <= limit for peak in peaks)
    assert short == () and planner.last.phase == "k=0"


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_is_a_policy_that_the_one_planner_carries_out(name):
    """A planner's code is a policy: it inherits the contract's defaults, never the step, the
    recovery or the persistence, which the one ``Planner`` holds."""
    cls = PLANNERS[name]
    assert issubclass(cls, Policy) and not issubclass(cls, Planner)
    assert cls.decide is not Policy.decide
    assert not any(hasattr(cls, method) for method in ("step", "run", "track", "save", "load"))
    model = _model()
    with build_planner(name, model, None, blocks="*") as planner:
        assert type(planner) is Planner and isinstance(planner.policy, cls) and planner.name == name
        assert planner.policy.parts is planner.parts


def test_every_planner_is_importable_from_the_package_without_importing_torch_first():
    import subprocess
    import sys

    code = ("import sys, mimose_cli; assert 'torch' not in sys.modules; "
            "from mimose_cli import Mimose, Sublinear, DTR, EveryN, FullCheckpointing, NoCheckpointing, Oracle, "
            "FullOffload, Decision, Planner, Policy; "
            "from mimose_cli.planners import PLANNERS, MimosePolicy, SublinearPolicy, DTRPolicy, EveryNPolicy, "
            "FullCheckpointingPolicy, NoCheckpointingPolicy, OraclePolicy, FullOffloadPolicy; "
            "assert {c.name for c in (MimosePolicy, SublinearPolicy, DTRPolicy, EveryNPolicy, FullCheckpointingPolicy, "
            "NoCheckpointingPolicy, OraclePolicy, FullOffloadPolicy)} == set(PLANNERS); "
            "assert all(callable(f) for f in (Mimose, Sublinear, DTR, EveryN, FullCheckpointing, NoCheckpointing, "
            "Oracle, FullOffload))")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_the_example_planner_measures_in_a_loop_of_ones_own(example_planner):
    """Without a meter passed, it builds its own (the README's own-loop use) and learns from it."""
    model = _model()
    planner = build_planner("cautious", model, int(_none_peak(model) * 1.05), blocks="*")
    try:
        for _ in range(3):
            _step(model, planner, 64)
            for p in model.parameters():
                p.grad = None
        assert planner.meter is not None and planner.meter.peak_bytes() > 0
        assert planner.policy.blocks_at.get(64, 0) >= 1  # the budget binds at length 64
    finally:
        planner.close()


def test_a_planner_is_not_subclassed_and_an_option_it_lacks_is_named():
    """Code written for the planner as a base class is told what to write instead, and an option
    the policy does not take names the planner and what it takes; neither leaves the model
    claimed."""
    with pytest.raises(TypeError, match="write a Policy"):
        class Old(Planner):  # noqa: F841 - defining it is the mistake
            pass
    model = _model()
    with pytest.raises(TypeError, match="planner 'sublinear' has no option selective; it takes variant"):
        build_planner("sublinear", model, "1GB", blocks="*", selective=True)
    with pytest.raises(ValueError, match="variant='fast' is invalid"):
        build_planner("sublinear", model, "1GB", blocks="*", variant="fast")
    build_planner("none", model, "1GB", blocks="*").close()  # the model is free


def test_the_planners_warnings_point_at_the_users_line():
    """However many of the planner's own frames lie between, a warning names the line of the
    user's code that called it: the constructor (``Mimose(...)``, ``Planner(...)``) and
    ``prepare``."""
    from mimose_cli.planners import Mimose, MimosePolicy

    model = _model()
    for make in (lambda: Mimose(model, blocks="*"), lambda: Planner(model, MimosePolicy, blocks="*")):
        with pytest.warns(UserWarning, match="without a budget") as caught:
            planner = make()
        planner.close()
        assert (caught[0].filename, caught[0].lineno) == (__file__, make.__code__.co_firstlineno)
    planner = build_planner("sublinear", model, 1, blocks="*")
    with pytest.warns(UserWarning, match="sublinear") as caught:
        planner.prepare(lambda size: torch.randn(*size, 32), (8, 64, 32))
    planner.close()
    assert {w.filename for w in caught} == {__file__}
    with Mimose(model, "1GB", blocks="*") as planner:
        with pytest.warns(UserWarning, match="no batch to probe with") as caught:
            with planner.step(input_size=(8, 64)):  # decided inside, entered through contextlib
                model(torch.randn(8, 64, 32)).sum().backward()
        assert caught[0].filename == __file__


@pytest.mark.parametrize("plan, says", [
    (("recompute", "keep", "keep"), "plan ('recompute', 'keep', 'keep') has 3 choices for 4 blocks: give one per block"),
    ((0, 1), "has 2 choices for 4 blocks"),
    (("keep", "keep", "keep", "checkpoint"), "holds unknown choice(s) 'checkpoint': use keep, selective, partial1"),
    (("keep", "keep", "keep", True), "holds unknown choice(s) True"),
    ("recompute", "plan 'recompute' is not one choice per block: give a tuple such as ('recompute', 'keep', 'keep', "),
    (("partial1", "keep", "keep", "keep"), "checkpoints blocks [(0, 'partial1')] partially, but the probes found no"),
])
def test_a_plan_that_is_not_one_choice_per_block_is_refused_in_one_line(plan, says):
    """A custom policy's ``Decision`` (and ``set_plan``) whose plan has the wrong length, a choice
    not in ``blocks.CHOICES`` or a partial level the probes found no outputs for raises ValueError
    in one line naming the problem, instead of running a plan other than the one given."""
    from mimose_cli.planners.baselines.uniform import NoCheckpointingPolicy
    from mimose_cli.planners.contract import Decision

    class Odd(NoCheckpointingPolicy):
        def decide(self, input_size, context=None):
            return Decision(plan)

    model = _model()
    planner = Planner(model, Odd, None, blocks="*")
    with pytest.raises(ValueError) as err:
        _step(model, planner, 8)
    assert str(err.value).startswith("Odd.decide returned ") and says in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=re.escape(says)):
        planner.set_plan(plan)
    planner.close()


def test_a_plan_is_one_choice_per_block_wherever_it_travels():
    """The helpers build plans from block indices (numpy's too), and the plan a policy decides is
    the one in force, in ``StepInfo`` and in ``planner.plan``, as a tuple of choices."""
    import numpy as np

    from mimose_cli.planners.baselines.uniform import NoCheckpointingPolicy
    from mimose_cli.planners.blocks import checkpointed, recompute_first, recomputed
    from mimose_cli.planners.contract import Decision

    assert recompute_first(2, 4) == ("recompute", "recompute", "keep", "keep")
    assert recomputed(np.flatnonzero([True, False, True, False]), 4) == ("recompute", "keep", "recompute", "keep")
    assert checkpointed(("keep", "selective", "offload", "partial2")) == (1, 3)

    class Mixed(NoCheckpointingPolicy):
        def decide(self, input_size, context=None):
            return Decision(["recompute", "keep", "selective", "offload"])

    model = _model()
    planner = Planner(model, Mixed, None, blocks="*")
    _step(model, planner, 8)
    assert planner.last.plan == planner.plan == ("recompute", "keep", "selective", "offload")
    planner.close()


def test_a_subclass_of_a_registered_policy_takes_its_options():
    """``PLANNERS`` says which options a planner takes; a policy derived from a registered one
    (a user's tweak of ``MimosePolicy``) is given the same, checked the same way."""
    from mimose_cli.planners import Planner
    from mimose_cli.planners.mimose.policy import MimosePolicy
    from mimose_cli.planners.options import MimoseOptions

    from helpers import tiny_bert

    class Tweaked(MimosePolicy):
        name = "tweaked"

    with Planner(tiny_bert(layers=2), Tweaked, "1GB", granularity=8) as planner:
        assert planner.parts.options == MimoseOptions(granularity=8) and planner.policy.granularity == 8
    with pytest.raises(ValueError, match="granularity=0"):
        Planner(tiny_bert(layers=2), Tweaked, "1GB", granularity=0)
