"""Build script: setuptools metadata lives in pyproject.toml; compiled
extensions (the C token trie under csrc/) are declared here."""

from setuptools import setup

setup()
