"""Structured output: answers held to a JSON schema, a regular expression, a choice or a grammar
(structured.py, with llguidance), and schemas made fit to end (schema_bounds.py)."""
