"""``kvctl help [TOPIC]``: man-style pages per command family and concept."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markdown import Markdown
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options
from kvctl.help import all_topics, complete_topic, get_topic


def help_command(
    ctx: typer.Context,
    topic: Annotated[
        str | None,
        typer.Argument(help="Topic (command family or concept); without it, list the topics.",
                       show_default=False, autocompletion=complete_topic),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Read a manual page: what a command family or concept is for, its commands, options,
    environment, exit status and examples. 'kvctl help' lists the topics.

    Example: kvctl help runbook | less -R
    """
    out = global_options(ctx).output(json_mode=json_out)
    if topic is None:
        topics = all_topics()
        if json_out:
            out.emit_json("help.topics", {"topics": [
                {"name": t.name, "summary": t.summary} for t in topics]})
            return
        table = Table(title="kvctl help topics", title_justify="left", show_header=False,
                      box=None, padding=(0, 2))
        table.add_column("topic", style="bold")
        table.add_column("summary")
        for t in topics:
            table.add_row(t.name, t.summary)
        out.print(table)
        out.print("\nRead one with [bold]kvctl help TOPIC[/bold]; every command also has "
                  "[bold]--help[/bold].")
        return
    page = get_topic(topic)
    if json_out:
        out.emit_json("help.topic", {"name": page.name, "summary": page.summary,
                                     "markdown": page.markdown})
        return
    if not json_out:  # a page reads best at most 100 columns wide, even in a wide pipe
        out.console.print(Markdown(page.markdown, code_theme="ansi_dark", hyperlinks=False),
                          width=min(out.console.width, 100))
