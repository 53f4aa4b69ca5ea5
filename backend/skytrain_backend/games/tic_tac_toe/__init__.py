"""Tic-tac-toe: the agent names a cell each turn against a random or minimax opponent.

``env`` has the board rules and opponents, ``agent`` the conversation and the reward,
the examples (``examples/tic_tac_toe``) and ``skytrain demo --task`` play it
against a model's endpoint.
"""
