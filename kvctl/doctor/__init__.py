"""Checks of the environment kvctl runs in (``kvctl doctor env``)."""
