"""The seed's games, shared by ``examples/`` and ``skytrain demo --task``.

Each game's rules (``env`` / ``puzzle``) and its conversation and reward (``agent``, an
``episode.Episode``) live here, in the installed package, so that the demo can play them;
the examples' rollout and training scripts import them from here. Nothing here talks to a
server: it needs only what the SDK-only install has (an import-linter contract), so the
examples run there too.
"""
