"""Where the benchmark scripts write their JSON, and in what shape."""

import json
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def write_results(benchmark: str, rows: list, **fields) -> Path:
    """Write ``results/<benchmark>.json`` — the machine, torch's version, ``fields`` (targets and
    settings) and the rows — and say where."""
    path = RESULTS / f"{benchmark}.json"
    result = {"benchmark": benchmark, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, **fields, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


def run_training(recipe, **kwargs):
    """``launcher.train.run_training``, but a run that a signal stopped (SIGTERM, Ctrl-C: the
    launcher ends it cleanly and returns it with status "interrupted", as a library call should)
    ends the benchmark too, instead of mixing a partial run into the figures and going on."""
    from mimose_cli.launcher import train  # here: scripts that only read results need no launcher

    result = train.run_training(recipe, **kwargs)
    if result.summary.get("status") == "interrupted":
        raise SystemExit(f"interrupted ({result.summary.get('signal')}): the benchmark stops here")
    return result
