"""The coding assistant's conversation with the model, one definition for the recipe
(`coding_solver.solve`) and for the embedded model trained to hold it (`tiny/corpus.py`): the
system prompt, where an answer's code is (its first fenced block), and the note appended after
a failed attempt."""

from __future__ import annotations

CODING_SYSTEM_PROMPT = "You are a careful Python programmer. Answer with one Python code block."


def extract_code(text: str) -> str | None:
    """The first fenced code block of a reply (None when there is none)."""
    start = text.find("```")
    if start < 0:
        return None
    body_start = text.find("\n", start)
    if body_start < 0:
        return None
    end = text.find("```", body_start)
    return text[body_start + 1 : end if end >= 0 else len(text)]


def code_failure_note(attempt: int, error: str) -> str:
    """What the coding recipe appends after rolling back to the code-block anchor."""
    return f"[attempt {attempt} failed: {error}. Fix the code.]\n"


def block_closed(text: str) -> bool:
    """True once the first code block of `text` has its closing fence (extract_code's rule)."""
    start = text.find("```")
    newline = text.find("\n", start) if start >= 0 else -1
    return newline >= 0 and text.find("```", newline) >= 0
