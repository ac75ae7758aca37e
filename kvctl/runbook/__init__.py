"""Runbooks: a sequence of checks with thresholds and one verdict table."""
