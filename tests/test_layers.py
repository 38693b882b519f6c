"""The package's imports run one way, from the commands down to the leaves, function-local
imports included; what a recipe validates imports no torch."""

import ast
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "mimose_cli"
LAYERS = [  # lowest first; a module may import its own layer and those below
    ("leaf", ("mimose_cli.units", "mimose_cli.files", "mimose_cli.torch_private")),
    ("memory", ("mimose_cli.memory",)),
    ("planners", ("mimose_cli.planners",)),
    ("runs", ("mimose_cli.runs",)),
    ("launcher", ("mimose_cli.launcher",)),
    ("cli", ("mimose_cli.cli",)),
    ("package", ("mimose_cli.__main__", "mimose_cli.entry", "mimose_cli")),
]


def layer_of(module: str) -> int:
    if module == "mimose_cli.__version__":  # a string in the package's lazy facade, which runs no module
        return 0
    for level, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "mimose_cli"):
            return level
    assert module in ("mimose_cli", "mimose_cli.__init__"), f"{module} is in no layer"
    return len(LAYERS) - 1


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> list:
    """(line, imported module) for every import of the package in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from mimose_cli.cli import train`` imports the submodule mimose_cli.cli.train
            found += [(node.lineno, _imported(node.module, alias.name)) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "mimose_cli"]


def _imported(module: str, name: str) -> str:
    """What ``from module import name`` imports: the submodule when ``name`` is one, else ``module``."""
    candidate = ROOT.joinpath(*module.split("."), name)
    if candidate.with_suffix(".py").exists() or candidate.is_dir() or name == "__version__":
        return f"{module}.{name}"
    return module


def upward_imports(folder: Path, rank_of, names: list, within: str = "mimose_cli") -> list:
    """Every import in ``folder`` of a module of ``within`` that ``rank_of`` ranks above the
    importing one, as ``path:line (its room) imports module (that room)``."""
    upward = []
    for path in sorted(folder.rglob("*.py")):
        here = module_name(path)
        for line, imported in package_imports(path):
            if imported.startswith(within) and rank_of(imported) > rank_of(here):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({names[rank_of(here)][0]}) imports "
                              f"{imported} ({names[rank_of(imported)][0]})")
    return upward


def test_no_module_imports_a_higher_layer():
    assert upward_imports(PACKAGE, layer_of, LAYERS) == []


def test_the_layer_check_sees_function_local_imports(tmp_path):
    source = tmp_path / "mimose_cli" / "planners" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from mimose_cli.launcher.recipe import Recipe\n")
    imported = [name for _, name in package_imports(source)]
    assert imported == ["mimose_cli.launcher.recipe"]
    assert layer_of(imported[0]) > layer_of("mimose_cli.planners.x")


def test_a_recipe_is_validated_without_importing_torch():
    code = ("import sys\nfrom mimose_cli.launcher.recipe import load_recipe\n"
            f"load_recipe({str(ROOT / 'recipes' / 'quickstart.yaml')!r}, ['planner.name=sublinear', "
            "'planner.sublinear.variant=sqrt'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


HOUSEHOLDS = [  # the planner wing's rooms, lowest first: a room may import its own and those below
    ("framework", "mimose_cli.planners"),
    ("mimose", "mimose_cli.planners.mimose"),
    ("baselines", "mimose_cli.planners.baselines"),
]  # planners.registry names the planners' modules as text, imported when first asked for


def household_of(module: str) -> int:
    return max(level for level, (_, prefix) in enumerate(HOUSEHOLDS)
               if module == prefix or module.startswith(prefix + "."))


def test_the_planner_framework_imports_no_planner_and_mimose_no_baseline():
    assert upward_imports(PACKAGE / "planners", household_of, HOUSEHOLDS, within="mimose_cli.planners") == []


def test_the_household_check_sees_the_framework_importing_a_baseline(tmp_path):
    source = tmp_path / "mimose_cli" / "planners" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("from mimose_cli.planners.baselines.dtr import DTRPolicy\n")
    (imported,) = [name for _, name in package_imports(source)]
    assert household_of(imported) > household_of("mimose_cli.planners.x")


def test_no_two_library_modules_share_a_name():
    """The library's modules (planners, memory) each have a name of their own, so that a name in
    a message, a docstring or a traceback points at one file."""
    names: dict = {}
    for wing in ("planners", "memory"):
        for path in (PACKAGE / wing).rglob("*.py"):
            if path.name != "__init__.py":
                names.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
