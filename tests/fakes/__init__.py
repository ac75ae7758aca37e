"""Faithful fakes of hardware APIs kvctl drives (see each package's docstring)."""
