"""Shared core of the data-parallel training suite: everything the four train_*.py scripts share."""

__version__ = "0.1.0"
