"""Temporal Clue: the agent solves a murder mystery from clues about who was where, when.

``puzzle`` generates puzzles with a unique solution, ``agent`` holds the prompt, the answer
format and the reward, the examples (``examples/temporal_clue``) and ``skytrain demo --task`` play it
against a model's endpoint.
"""
