"""Temporal Clue: the agent solves a murder mystery from clues about who was where, when.

``puzzle`` generates puzzles with a unique solution, ``agent`` holds the prompt, the answer
format and the reward, ``rollout`` asks a model's endpoint, ``train`` is the training script.
"""
