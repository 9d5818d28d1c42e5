"""Datasets of tasks (prompt messages, tools allowed, reward spec) and synthetic task generators."""
