"""Environments: the tool protocol and built-in tools, reward functions, dotted-path lookup."""
