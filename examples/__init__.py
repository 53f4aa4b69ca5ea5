"""Agent tasks trained with skytrain: 2048, tic-tac-toe, Temporal Clue and an email search agent.

Each task is a package (``examples.<name>``) with a seeded environment, a rollout that talks
to the model only through its OpenAI-compatible endpoint, a reward, an eval and a training
script (``python -m examples.<name>.train --help``).
"""
