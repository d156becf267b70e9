"""Rollout engines: sampling completions from the current policy behind one interface."""
