"""Chat templates rendered in the engine's own budgeted Jinja sandbox (`sandbox.render_template`):
transformers' environment and inputs (`inputs`), so the text is the same, with a deadline, an output
cap and size checks before anything large is built (`budget`, `guards`, `filters`)."""
