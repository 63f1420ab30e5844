"""Attention backends beyond the learner's reference: the fast one the engine and the server use by default."""
