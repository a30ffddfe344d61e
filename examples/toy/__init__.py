"""The embedded default recipe (``astralight run`` with no arguments): see recipe.yaml.

This folder is installed as the package ``astralight.toy`` so the recipe ships in the wheel.
"""
