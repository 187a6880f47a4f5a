"""Sequence classification: a `*ForSequenceClassification` checkpoint's label (and score) per row."""
