"""kvctl: the operator's toolkit for the KV-cache fabric of disaggregated LLM inference.

The package is a library first (``kvctl.probe``, ``kvctl.topo``, ``kvctl.transfer``,
``kvctl.store``, ``kvctl.keys``) with a thin command-line layer on top
(``kvctl.cli`` and ``kvctl.commands``). The library never imports Typer or Rich.
"""

__version__ = "0.1.0"

#: Version of every ``--json`` document kvctl prints. Bump on incompatible changes.
#: 2: every ``kind`` is dotted (``doctor.env``, not ``doctor-env``); verdicts are ``ok`` plus
#: ``checks[].status``; fields named by unit. docs/json.md lists what changed and the aliases.
SCHEMA_VERSION = 2
