"""Command-line help from module docstrings, shared by every ``python -m`` entry point."""

from __future__ import annotations

import re


def description(doc: str, paragraph: int = 0) -> str:
    """Paragraph ``paragraph`` of a docstring as plain text for ``--help``: reST literals
    (````x````) and roles (``:func:`x```) lose their markup."""
    text = doc.strip().split("\n\n")[paragraph]
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)
