"""mkdocs hook: the command-line reference is generated from ckptio's own argument parsers at build time,
so it cannot drift from the commands. Replaces ``<!-- cli-reference -->`` in cli.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"


def _reference() -> str:
    import os

    os.environ["COLUMNS"] = "100"  # the same line width on every machine
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from ckptio.cli import build_parser

    parser = build_parser()
    parser.prog = "ckptio"
    out = ["```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        out += [f"## ckptio {name}", "", "```text", command.format_help().rstrip(), "```", ""]
        inner = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        for action in inner:
            for sub_name, sub_command in action.choices.items():
                out += [f"### ckptio {name} {sub_name}", "", "```text", sub_command.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs' hook signature
    if MARKER in markdown:
        return markdown.replace(MARKER, _reference())
    return markdown
