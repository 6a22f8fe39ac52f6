"""Ready programs built on the FreeToken SDK, one module per recipe, each runnable on the embedded
default model as `freetoken recipe NAME` (or `python -m freetoken_agents.recipes.NAME`).

- `coding_assistant`: the model writes a function; its tests run in a sandbox; on failure the
  model rolls back to the code-block anchor, reads the error and writes it again.
- `tool_loop`: an `Agent` over the embedded model's tools, one of them flaky, events printed.
- `langchain_agent`: `langchain.agents.create_agent` over `ChatFreeToken`.
"""

from __future__ import annotations

RECIPES: dict[str, str] = {
    "coding_assistant": "the model writes a function, runs its tests in a sandbox, rolls back and retries",
    "tool_loop": "an Agent with two tools (one flaky) on a plain event loop, with the trace summary",
    "langchain_agent": "langchain.agents.create_agent with ChatFreeToken and two tools",
}
"""Recipe name -> one-line description (the module is `freetoken_agents.recipes.<name>`)."""


class RecipeError(Exception):
    """Raised when a recipe cannot run: an unknown recipe name, a missing optional dependency
    (with the install command), or a bad argument. The CLI prints it as one line, exit code 1."""
