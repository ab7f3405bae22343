"""Declarative model specs (torch-free) and the torch builders that turn them into stage modules."""
