"""Tic-tac-toe: the agent names a cell each turn against a random or minimax opponent.

``env`` has the board rules and opponents, ``agent`` the conversation and the reward,
``rollout`` plays a game against a model's endpoint, ``train`` is the training script.
"""
