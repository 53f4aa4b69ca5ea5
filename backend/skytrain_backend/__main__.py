"""``python -m skytrain_backend``: the ``skytrain`` command, for subprocesses started by path."""

from skytrain_backend.cli import main

main()
