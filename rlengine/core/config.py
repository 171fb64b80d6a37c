"""Moved to ``rlengine.config`` (this alias warns; it goes in the next minor version)."""

from rlengine._moved import alias

alias(__name__)
