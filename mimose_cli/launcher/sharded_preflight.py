"""The pre-flight of ``training.parallel=fsdp``: what each rank holds sharded and what a step needs
on it, measured on every rank of the run (``mimose train --dry-run --nproc-per-node N``).

Each rank measures its own step at the recipe's largest input, as one process does
(``preflight.preflight``), on its sharded model: the simulated device (or the GPU) counts its
shards, the blocks FSDP gathers and the gradients it reduce-scatters, and the activations of its
batch. Only the state divides by the number of ranks; what is left of a step's need (activations,
gathered blocks) does not, which gives the estimate for another number of ranks
(``RankNeeds.estimate``): how many a budget needs at least, and whether one device could hold the
run at all.
"""

from dataclasses import dataclass

from mimose_cli.launcher.distributed import World, all_ranks, process_group, quiet_unless_main
from mimose_cli.launcher.preflight import BudgetRange, budget_error, optimizer_state_bytes, preflight
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.sharding import check_world, held_param_bytes, largest_block_bytes
from mimose_cli.launcher.step import build_trainer, resolve_device
from mimose_cli.runs.live import new_console
from mimose_cli.units import format_budget, format_bytes

MAX_RANKS = 4096
"""The most ranks the estimate considers."""


@dataclass
class RankNeeds:
    """One rank's pre-flight under fsdp (bytes)."""

    rank: int
    world_size: int
    weights_bytes: int
    """This rank's shard of the weights (and as much for its shard of the gradients)."""
    optimizer_bytes: int
    """This rank's shard of the optimizer's state, once its first step allocates it."""
    gathered_bytes: int
    """The largest block's weights gathered whole (in the dtype they are gathered in)."""
    needs: BudgetRange
    """The step's measured needs on this rank, its sharded state included."""

    @property
    def sharded_bytes(self) -> int:
        """What divides by the number of ranks: weights, gradients, optimizer state."""
        return 2 * self.weights_bytes + self.optimizer_bytes

    def estimate(self, ranks: int) -> int | None:
        """The least-memory plan's need per rank with ``ranks`` ranks: the measured need with the
        state scaled from this run's ranks to ``ranks`` (None: not measurable)."""
        if self.needs.full_bytes is None:
            return None
        rest = self.needs.full_bytes - self.sharded_bytes
        return rest + -(-self.sharded_bytes * self.world_size // ranks)

    def describe(self) -> str:
        return (f"rank {self.rank}: holds 1/{self.world_size} of the state, weights {format_bytes(self.weights_bytes)} "
                f"+ gradients {format_bytes(self.weights_bytes)} + optimizer state {format_bytes(self.optimizer_bytes)}, "
                f"and gathers up to {format_bytes(self.gathered_bytes)} per block; {self.needs.describe()}")


def least_ranks(ranks: list, budget_bytes: int) -> int | None:
    """The fewest ranks whose every rank's estimated need fits ``budget_bytes`` (None: none up to
    ``MAX_RANKS``: the activations and gathered blocks alone are over it)."""
    for count in range(1, MAX_RANKS + 1):
        estimates = [r.estimate(count) for r in ranks]
        if all(e is not None and e <= budget_bytes for e in estimates):
            return count
    return None


def unsharded_state_bytes(ranks: list) -> int:
    """The state one device would hold unsharded: every rank's shards of the weights, gradients
    and optimizer state, and the optimizer step's scratch (about the weights again, as
    ``preflight.model_state_error`` counts it); no plan changes it."""
    weights = sum(r.weights_bytes for r in ranks)
    optimizer = sum(r.optimizer_bytes for r in ranks)
    return 2 * weights + optimizer + (weights if optimizer else 0)


def verdict(ranks: list, budget_bytes: int | None, written: str | None = None) -> tuple[bool, str | None]:
    """Whether the budget fits every rank, and the line that says what it means: sharded over this
    many ranks or not, whether one device could hold the state at all, and the fewest ranks that
    fit."""
    if budget_bytes is None:
        return True, None
    budget = format_budget(written, budget_bytes)
    world = ranks[0].world_size
    least = least_ranks(ranks, budget_bytes)
    fewest = ("no number of ranks fits it (activations and gathered blocks alone are over it): lower "
              "training.batch_size or data.max_length" if least is None
              else f"the fewest ranks that fit it: {least} (estimated: the state divides by the ranks, the rest does not)")
    failing = [r for r in ranks if budget_error(budget_bytes, r.needs, written) is not None]
    if failing:
        worst = max(failing, key=lambda r: float("inf") if r.needs.full_bytes is None else r.needs.full_bytes)
        need = worst.needs.full_bytes
        return False, (f"budget {budget} is too small sharded over {world} ranks: rank {worst.rank} needs "
                       f"{'more than the device holds' if need is None else format_bytes(need)} "
                       f"{worst.needs.least}; {fewest}")
    state = unsharded_state_bytes(ranks)
    alone = (f"one device cannot hold it unsharded (weights, gradients, optimizer state and its step's scratch: "
             f"{format_bytes(state)} before any activation)" if state > budget_bytes else
             "one device may hold it unsharded too (its state fits; the dry run of training.parallel=ddp says)")
    return True, f"budget {budget}: fits sharded over {world} ranks; {alone}; {fewest}"


def measure_rank(recipe, config, world: World) -> RankNeeds:
    """This rank's ``RankNeeds``: its sharded model built and its step measured at the largest input."""
    trainer = build_trainer(recipe, config, total_steps=1, world=world)
    try:
        with trainer.meter.activate():
            trainer.meter.track(trainer.model, trainer.optimizer)
            state_bytes = optimizer_state_bytes(trainer.optimizer)
            needs = preflight(trainer, config, state_bytes)
        gathered = largest_block_bytes(trainer.planner.blocks, recipe.training.precision)
    finally:
        trainer.planner.close()
    return RankNeeds(world.rank, world.size, held_param_bytes(trainer.model), state_bytes, gathered, needs)


def sharded_dry_run(recipe, console=None, world: World | None = None) -> bool:
    """Every rank of ``world`` (torchrun's by default) measures its needs (``measure_rank``); rank
    0 prints each rank's and the verdict. Returns whether the budget fits, the same on every rank."""
    world = world or World.from_env()
    check_world(world.size)
    console = console or new_console()
    config = model_config(recipe)
    with process_group(world, resolve_device(recipe.device)), quiet_unless_main(world):
        return report_ranks(recipe, config, console, world)


def report_ranks(recipe, config, console, world: World) -> bool:
    """``sharded_dry_run`` among ranks that have joined already: each measures, rank 0 prints."""
    ranks = all_ranks(measure_rank(recipe, config, world), world)
    fits, line = verdict(ranks, recipe.budget_bytes, recipe.budget)
    if world.is_main:
        console.print(f"{recipe.model.type} ({recipe.model.size}), fsdp over {world.size} ranks:", highlight=False)
        for rank in ranks:
            console.print(f"  {rank.describe()}", highlight=False, soft_wrap=True)
        if line is not None:
            console.print(line if fits else f"[red]{line}[/red]", highlight=False, soft_wrap=True)
    return fits
