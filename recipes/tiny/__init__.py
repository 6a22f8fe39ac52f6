"""The embedded default model: its world (tools, coding tasks), corpus, training and evaluation."""
