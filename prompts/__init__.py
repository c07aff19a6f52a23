"""Prompt sets shipped with flowrl and a loader for text and jsonl files."""
