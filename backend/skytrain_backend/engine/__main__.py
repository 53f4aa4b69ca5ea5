"""``python -m skytrain_backend.engine serve ...``: how the worker starts the CPU engine."""

from skytrain_backend.engine.cli import engine_app

engine_app()
