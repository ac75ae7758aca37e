"""``kvctl topo``: placeholder until the topo module lands."""

import typer

app = typer.Typer(help="GPU-NIC PCIe affinity.", no_args_is_help=False)


@app.callback(invoke_without_command=True)
def topo() -> None:
    """Show the topology.

    Example: kvctl topo
    """
