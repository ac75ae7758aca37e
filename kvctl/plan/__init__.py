"""Planners: back-of-the-envelope answers from model shapes and measured rates."""
