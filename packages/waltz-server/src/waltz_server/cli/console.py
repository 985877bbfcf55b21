"""``waltz console``: the web console for operators, from the waltz-console package
(imported when the CLI starts only if installed; its own imports wait until it runs)."""

from __future__ import annotations

import click


def console_command() -> click.Command:
    try:
        from waltz_console.cli import console_command as command
    except ImportError as exc:
        missing = str(exc)

        @click.command(
            "console", context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
        )
        def command() -> None:
            """The web console for operators (pip install waltz-console)."""
            raise click.ClickException(
                f"{missing}: install the console first (pip install waltz-console)"
            )

    return command
