"""Text in and out: chat templates, tokenisation, incremental detokenisation, stop tokens and stop
strings."""
