"""2048: the agent slides tiles one move per turn until it reaches the target tile.

``env`` has the board rules, ``agent`` the conversation and the reward, ``rollout`` plays a
game against a model's endpoint, ``train`` is the training script.
"""
