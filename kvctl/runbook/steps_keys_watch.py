"""The runbook check ``keys-live`` ("keys: live agreement"): watch the instances' live KV
events for a while and judge them — every instance's hashes equal to the profile's, no two
instances hashing the same content differently, every endpoint answering::

    - check: keys-live
      name: "keys: live agreement"
      endpoints: ["a=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558", "b=tcp://10.0.0.6:5557"]
      profile: vllm:sha256_cbor
      duration_s: 30
      min_blocks: 100

Registered by :func:`kvctl.runbook.model.step_kinds` with the built-in kinds.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from kvctl.errors import ConfigError
from kvctl.runbook.model import CheckResult, RunContext, Verdict, register_step

#: The check's display name.
TITLE = "keys: live agreement"


@dataclasses.dataclass(frozen=True)
class KeysLiveParams:
    """``keys-live``: the publishers, the key settings (default: the ``keys`` section), how
    long to watch, and how many verified blocks make the fidelity rows pass (fewer: skip).

    ``lora_paths`` as vLLM's ``--lora-modules`` (``NAME=PATH``); ``record``: keep the
    stream (``kvctl sim trace --format kv-events FILE`` replays it).
    """

    endpoints: list[str] = dataclasses.field(default_factory=list)
    profile: str | None = None
    block_size: int | None = None
    lora_paths: list[str] = dataclasses.field(default_factory=list)
    duration_s: float = 30.0
    max_events: int | None = None
    min_blocks: int = 1
    window_s: float = 60.0
    record: Path | None = None


@register_step("keys-live", KeysLiveParams, TITLE + " (live KV events hash alike)")
def keys_live(params: KeysLiveParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.keys.manifest import config_from_settings
    from kvctl.keys.settings import KeysSettings
    from kvctl.keys.watch.session import WatchOptions, WatchSession
    from kvctl.keys.watch.source import parse_endpoint

    if not params.endpoints:
        raise ConfigError("keys-live: no endpoints",
                          "list the engines' KV-event endpoints under 'endpoints'")
    if not 0 < params.duration_s < float("inf"):  # .inf in YAML: a check that never ends
        raise ConfigError(f"keys-live: duration_s {params.duration_s:g} is not a positive "
                          "number of seconds", "watch for some seconds, e.g. duration_s: 30")
    for name, value in (("max_events", params.max_events), ("window_s", params.window_s)):
        if value is not None and not value > 0:
            raise ConfigError(f"keys-live: {name} {value:g} is not positive",
                              f"give {name} above 0, or leave it out")
    settings = ctx.settings(KeysSettings)
    settings = dataclasses.replace(
        settings, profile=params.profile or settings.profile,
        block_size=params.block_size if params.block_size is not None else settings.block_size,
        lora_paths=tuple(params.lora_paths) or settings.lora_paths)
    config = config_from_settings(settings)
    endpoints = [parse_endpoint(e) for e in params.endpoints]
    ctx.progress(f"watching {len(endpoints)} instance(s) for {params.duration_s:g} s")
    options = WatchOptions(duration_s=params.duration_s, max_events=params.max_events,
                           window_s=params.window_s)
    with WatchSession(endpoints, config, options, record=params.record) as session:
        session.run(threading.Event())
        doc = session.summary(final=True)
    return list(_rows(doc, params.min_blocks))


def _rows(doc: dict[str, Any], min_blocks: int) -> list[CheckResult]:
    rows: list[CheckResult] = []
    instances = {r["name"]: r for r in doc["instances"]}
    for check in doc["checks"]:
        name, status = check["name"], check["status"]
        detail = check.get("detail", "")
        inst = instances.get(name.split(": ", 1)[-1])
        verdict = {"pass": Verdict.PASS, "fail": Verdict.FAIL}.get(status, Verdict.SKIP)
        hint = None
        if name.startswith("fidelity: ") and inst is not None:
            if verdict is Verdict.PASS and inst["verified"] < min_blocks:
                verdict = Verdict.SKIP
                detail = f"only {inst['verified']} block(s) verified, fewer than {min_blocks}"
            if verdict is Verdict.FAIL:
                hint = ("set the engine's --prefix-caching-hash-algo and PYTHONHASHSEED as "
                        "the profile says, or the profile as the engine runs")
        elif name.startswith("agreement: ") and verdict is Verdict.FAIL:
            hint = ("the instances cannot share KV: give them the same hash algorithm, "
                    "PYTHONHASHSEED and block size")
        elif name.startswith("reachable: "):
            hint = "check the endpoint and the engine's --kv-events-config"
        rows.append(CheckResult(name, verdict, detail, "", hint,
                                {"instance": inst} if inst is not None else {}))
    totals = doc["totals"]
    rows.append(CheckResult(
        "pool", Verdict.PASS,
        f"{totals['duplicate_tokens']:,} of {totals['computed_tokens']:,} prefill tokens were "
        "held by another instance when computed", "", None, {"totals": totals}))
    return rows
