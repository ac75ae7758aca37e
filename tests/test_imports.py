"""Every kvctl module imports on its own, first thing in a process (no circular import
that only the usual import order hides)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: For each module: forget every kvctl module, then import it alone; print what failed.
SCRIPT = r"""
import importlib, pathlib, sys
root = pathlib.Path("kvctl")
names = sorted(".".join(p.with_suffix("").parts[:-1] if p.name == "__init__.py"
                        else p.with_suffix("").parts)
               for p in root.rglob("*.py") if p.name != "__main__.py")  # that one runs the CLI
bad = []
for name in names:
    for loaded in [m for m in sys.modules if m == "kvctl" or m.startswith("kvctl.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # an optional package (pyverbs, nixl, torch...)
        if (exc.name or "").startswith("kvctl"):
            bad.append(f"{name}: {exc!r}")
    except Exception as exc:
        bad.append(f"{name}: {exc!r}")
print(len(names))
print("\n".join(bad))
"""


def test_every_module_imports_first() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    count, *bad = done.stdout.strip().splitlines()
    assert int(count) > 200
    assert [b for b in bad if b] == []
