"""mimose recipes: the shipped recipes, a line each."""

from pathlib import Path

import typer

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "quickstart.yaml"


def summary_line(path: Path) -> str:
    """A recipe's first comment sentence (what it trains)."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        words.append(line.lstrip("# "))
    return " ".join(words).split(". ")[0].rstrip(".")


def recipes():
    """List the shipped recipes, a line each."""
    found = sorted(RECIPES_DIR.glob("*.yaml"))
    if not found:
        raise ValueError(f"no recipes in {RECIPES_DIR}: they ship with the source tree (git clone), "
                         "not with an installed wheel")
    width = max(len(str(p.relative_to(RECIPES_DIR.parent))) for p in found)
    for path in found:
        typer.echo(f"{str(path.relative_to(RECIPES_DIR.parent)):<{width}}  {summary_line(path)}")
