"""Write each harness's named seeds into fuzz/corpus/<harness>/ (run after changing seeds):

    python -m fuzz.make_seeds
"""

from __future__ import annotations

from pathlib import Path

HARNESSES = ("transfer", "store", "metadata")


def main() -> None:
    import importlib

    root = Path(__file__).parent / "corpus"
    for name in HARNESSES:
        module = importlib.import_module(f"fuzz.fuzz_{name}")
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        for seed, data in module.seeds().items():
            (out / seed).write_bytes(data)


if __name__ == "__main__":
    main()
