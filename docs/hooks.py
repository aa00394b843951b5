"""The command-line reference of cli.md, generated from ckptio's own argument parsers: written into the page
between ``<!-- cli-reference -->`` and ``<!-- end of cli-reference -->`` (so the page reads whole where it is
shown as a file), refreshed by the site build (an mkdocs hook), and kept equal to the commands by
``tests/test_docs.py``. ``python docs/hooks.py`` rewrites it in cli.md after a command changes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER, END = "<!-- cli-reference -->", "<!-- end of cli-reference -->"
PAGE = Path(__file__).resolve().parent / "cli.md"


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


def with_reference(markdown: str) -> str:
    """``markdown`` with the reference between the markers made anew."""
    head, _, rest = markdown.partition(MARKER)
    _, _, tail = rest.partition(END)
    return f"{head}{MARKER}\n\n{_reference()}\n{END}{tail or chr(10)}"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs' hook signature
    if MARKER in markdown:
        return with_reference(markdown)
    return markdown


if __name__ == "__main__":
    PAGE.write_text(with_reference(PAGE.read_text()))
