"""Command modules: one thin module per command family (parse, call the library, render)."""
