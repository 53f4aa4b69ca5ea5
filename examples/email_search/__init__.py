"""Email search: the agent answers a question about an inbox with a keyword search tool.

``inbox`` generates inboxes and questions, ``agent`` holds the tools, the multi-turn
tool-calling conversation and the reward, ``rollout`` runs it against a model's endpoint,
``train`` is the training script.
"""
