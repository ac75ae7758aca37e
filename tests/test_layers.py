"""The layers hold: no kvctl module imports a layer above its own.

Every module's imports are read with :mod:`ast` (top level, inside functions and under
``TYPE_CHECKING`` alike: a lazy import is a dependency too), relative ones resolved, and
each rule below names the modules it binds and the ones they must not import. A failure
names the file, the line and the import.

The floors, bottom up (a package may import its own floor and the ones below; the modules
on no floor, such as ``errors``, ``config`` or ``units``, are shared by all):

- ``probe``, ``net``: host discovery, framing and token auth;
- ``metadata``: the metadata service clients and server;
- ``transfer``, ``topo``: the transfer engine; the PCIe model;
- ``store``, ``bench``, ``keys``, ``sim``, ``doctor``, ``plan``, ``top``, ``help`` (the topic
  pages and the command tree's help text, which completes ``--profile`` from ``keys``);
- ``runbook``;
- ``cluster``;
- and the CLI layer over them all (``cli``, ``commands``, ``output``), the only modules that
  import Typer or Rich.

Inside the store, its state backends (``store.state``) and its client and node sides never
import the master.

:data:`KNOWN` lists the imports that break a rule today, each with why it is left for now
(issue 29's later steps); one that is gone fails the test until its line is removed, so the
list only shrinks.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Floors, lowest first (see the module docstring).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("probe", "net"),
    ("metadata",),
    ("transfer", "topo"),
    ("store", "bench", "keys", "sim", "doctor", "plan", "top", "help"),
    ("runbook",),
    ("cluster",),
)
#: The command line: it may import anything, and nothing below it imports it.
CLI = ("kvctl.cli", "kvctl.commands", "kvctl.output", "kvctl.__main__")
#: The store's client side and node side (modules of ``kvctl.store``).
STORE_CLIENT = tuple(f"kvctl.store.{m}" for m in (
    "client", "rpc", "arena", "recall", "datapath", "localcopy", "shmmap"))
STORE_NODE = tuple(f"kvctl.store.{m}" for m in ("node", "ssd", "taskthread", "allocator"))


@dataclasses.dataclass(frozen=True)
class Rule:
    """Modules under any of ``modules`` import nothing under any of ``banned``."""

    name: str
    modules: tuple[str, ...]
    banned: tuple[str, ...]
    #: modules under ``modules`` the rule leaves alone
    exempt: tuple[str, ...] = ()


#: ``(rule name, importing module, imported module)`` that break a rule today, and why.
KNOWN: dict[tuple[str, str, str], str] = {}


def _floor_rules() -> list[Rule]:
    rules = []
    for level, floor in enumerate(FLOORS):
        above = tuple(f"kvctl.{p}" for upper in FLOORS[level + 1:] for p in upper)
        rules.append(Rule(f"{'/'.join(floor)} import no floor above theirs",
                          tuple(f"kvctl.{p}" for p in floor), above + CLI))
    return rules


RULES: list[Rule] = [
    Rule("metadata is a layer under transfer, store and cluster", ("kvctl.metadata",),
         ("kvctl.transfer", "kvctl.store", "kvctl.cluster", "kvctl.bench", "kvctl.runbook",
          "kvctl.commands", "kvctl.cli")),
    Rule("store state backends import neither the master nor the client or node side",
         ("kvctl.store.state",), ("kvctl.store.master", *STORE_CLIENT, *STORE_NODE)),
    Rule("the store's client and node sides never import the master",
         STORE_CLIENT + STORE_NODE, ("kvctl.store.master",)),
    Rule("the library never imports the command line", ("kvctl",),
         ("kvctl.cli", "kvctl.commands"), exempt=CLI),
    Rule("the library never imports Typer or Rich", ("kvctl",),
         ("typer", "rich", "click"), exempt=CLI),
    Rule("Typer through its public API only, never click", ("kvctl",),
         ("click", "typer._")),
    *_floor_rules(),
]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") or (p.endswith("._") and
               name.startswith(p)) for p in prefixes)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, *, package: bool) -> Iterator[tuple[int, str]]:
    """``(line, imported name)`` for every import in ``source`` (of ``module``; ``package``
    when it is an ``__init__``), relative imports made absolute; ``from a import b`` gives
    ``a`` and ``a.b`` (``b`` may be a module)."""
    here = module if package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


@dataclasses.dataclass(frozen=True, order=True)
class Violation:
    path: str
    line: int
    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.name}"


def violations(rule: Rule, files: list[Path], root: Path = ROOT) -> list[Violation]:
    """What breaks ``rule`` in ``files``, in file and line order (one per line and
    banned module)."""
    found: list[Violation] = []
    for path in files:
        module = module_name(path, root)
        if not _under(module, rule.modules) or _under(module, rule.exempt):
            continue
        seen: set[tuple[int, str]] = set()
        for line, name in imports(path.read_text(), module, package=path.name == "__init__.py"):
            banned = next((b for b in rule.banned if _under(name, (b,))), None)
            if banned is not None and (line, banned) not in seen:
                seen.add((line, banned))
                found.append(Violation(str(path.relative_to(root)), line, module, name))
    return sorted(found)


FILES = sorted((ROOT / "kvctl").rglob("*.py"))
MODULES = [module_name(p) for p in FILES]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_layer_rule_holds(rule: Rule) -> None:
    for prefix in rule.modules:  # a renamed module must not switch its rule off quietly
        assert any(_under(m, (prefix,)) for m in MODULES), f"{prefix} names no module"
    found = violations(rule, FILES)
    known = {(m, n) for (r, m, n) in KNOWN if r == rule.name}
    new = [str(v) for v in found if (v.module, v.name) not in known]
    assert not new, f"{rule.name}:\n" + "\n".join(new)
    gone = known - {(v.module, v.name) for v in found}
    assert not gone, f"no longer imported, remove from KNOWN: {sorted(gone)}"


def test_known_breaks_name_existing_rules() -> None:
    assert {r for (r, _, _) in KNOWN} <= {rule.name for rule in RULES}


def test_every_package_is_on_a_floor_or_shared() -> None:
    """A new package has to be placed: on a floor, in the CLI layer, or among the shared
    modules (which import no floor above ``net``)."""
    floored = {p for floor in FLOORS for p in floor}
    cli = {c.split(".")[1] for c in CLI}
    shared = {"errors", "config", "units", "metrics", "wording", "yamlfile", "fsafe",
              "nativelog", "models", "cache", "argv", "verdict"}
    tops = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert tops - floored - cli - shared == set()
    rule = Rule("shared modules import no floor above net",
                tuple(f"kvctl.{s}" for s in shared),
                tuple(f"kvctl.{p}" for floor in FLOORS[1:] for p in floor) + CLI)
    assert [str(v) for v in violations(rule, FILES)] == []


def test_a_violation_is_named_with_its_file_line_and_import(tmp_path: Path) -> None:
    """The reader itself: top-level, function-level and relative imports are all seen."""
    pkg = tmp_path / "kvctl" / "metadata"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(
        "from __future__ import annotations\n"
        "import kvctl.transfer.engine\n"
        "def f() -> None:\n"
        "    from kvctl.store import client\n"
        "from ..cluster import agent\n"
        "from . import base\n")
    rule = RULES[0]
    found = violations(rule, sorted((tmp_path / "kvctl").rglob("*.py")), tmp_path)
    assert [str(v) for v in found] == [
        "kvctl/metadata/bad.py:2: kvctl.metadata.bad imports kvctl.transfer.engine",
        "kvctl/metadata/bad.py:4: kvctl.metadata.bad imports kvctl.store",
        "kvctl/metadata/bad.py:5: kvctl.metadata.bad imports kvctl.cluster",
    ]
