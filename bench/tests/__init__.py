"""Tests of the bench scripts' own logic on synthetic data (no GPU)."""
