"""How numbers and names read in the Markdown this package writes (model cards)."""

from __future__ import annotations

from typing import Any


def num(value: Any) -> str:
    """A number as a card shows it: floats to 4 significant digits, the rest as written."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def code(value: Any) -> str:
    """A name or value as code, or "-" for none."""
    return f"`{value}`" if value not in (None, "") else "-"


def paper_link(paper: dict[str, str]) -> str:
    """[title](its page on the Hub) of a paper with an arXiv id."""
    return f"[{paper['title']}](https://huggingface.co/papers/{paper['id']})"
