"""Verified work: signed receipts for received activations, and spot checks of a stage's forward."""
