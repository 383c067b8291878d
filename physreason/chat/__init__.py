"""Chat layer: system prompts, message building, multiple-choice formatting, completion parsing."""
