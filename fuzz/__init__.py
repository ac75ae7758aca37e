"""Coverage-guided (atheris) harnesses for kvctl's wire protocols; see fuzz/README.md."""
