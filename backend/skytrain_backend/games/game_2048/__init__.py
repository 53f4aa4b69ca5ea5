"""2048: the agent slides tiles one move per turn until it reaches the target tile.

``env`` has the board rules, ``agent`` the conversation and the reward, the examples (``examples/game_2048``) and ``skytrain demo --task`` play it
against a model's endpoint.
"""
