"""The ``mimose`` command: one module per command, each thin (parse, load, call one function)."""

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch.",
)


def _register() -> None:
    from mimose_cli.cli import report, train

    app.command("train", context_settings={"allow_extra_args": False})(train.train)
    app.command("report")(report.report)
    try:
        from mimose_cli.cli import compare
    except ImportError:  # compare lands with the baselines
        return
    app.command("compare")(compare.compare)


_register()


def main() -> None:
    app()
