"""The entry point of a MARS checkpoint's ``custom_generate/`` folder: transformers loads this file (and the
sibling modules it imports) and calls `generate(*args, model=model, **kwargs)`."""

from .api import generate  # noqa: F401
