"""``kvctl verify-keys``: do all instances compute the same prefix-chained block keys?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options
from kvctl.config import CommonSettings
from kvctl.errors import ExitCode, UsageError
from kvctl.keys.compare import Comparison, PairResult, compare
from kvctl.keys.manifest import (
    Manifest,
    config_from_settings,
    emit,
    manifest_to_json,
    read_manifest,
    write_manifest,
)
from kvctl.keys.profiles import KeyConfig, known_profiles
from kvctl.keys.prompts import load_tokenizer, read_prompts
from kvctl.keys.selfcheck import CheckResult, self_check, tenant_isolation
from kvctl.keys.settings import KeysSettings
from kvctl.keys.store_check import (
    BACKENDS,
    StoreCheckReport,
    Verdict,
    check_expect_hit,
    check_store,
    open_store,
)
from kvctl.output import Output
from kvctl.store.embedded import resolve_master
from kvctl.store.settings import StoreSettings
from kvctl.verdict import check_entry
from kvctl.wording import plural

app = typer.Typer(help="Check that every instance names KV blocks with the same keys.\n\n"
                  "Without a command: self-check the key scheme; with --store ADDR --prompts "
                  "FILE: how many leading blocks of each prompt a live store holds, and which "
                  "block breaks the chain.\n\n"
                  "Example: kvctl verify-keys compare host-a.json host-b.json\n\n"
                  "Example: kvctl verify-keys --store 127.0.0.1:50051 --prompts p.jsonl "
                  "--expect-hit 0.9",
                  no_args_is_help=False)

ProfileOpt = Annotated[str | None, typer.Option(
    "--profile", help="Key profile, e.g. vllm:sha256_cbor (see 'verify-keys profiles').",
    show_default=False)]
BlockSizeOpt = Annotated[int | None, typer.Option(
    "--block-size", help="Tokens per block (default: the profile's).", show_default=False)]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model id.", show_default=False)]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Model revision.",
                                                 show_default=False)]
TenantOpt = Annotated[str | None, typer.Option("--tenant", help="Tenant id.",
                                               show_default=False)]
KvDtypeOpt = Annotated[str | None, typer.Option("--kv-dtype", help="KV cache dtype.",
                                                show_default=False)]
KvLayoutOpt = Annotated[str | None, typer.Option("--kv-layout", help="KV cache layout.",
                                                 show_default=False)]
LoraNameOpt = Annotated[str | None, typer.Option(
    "--lora-name", help="LoRA adapter for prompts that name none.", show_default=False)]
LoraPathOpt = Annotated[str | None, typer.Option("--lora-path", help="That adapter's path.",
                                                 show_default=False)]
SeedFieldOpt = Annotated[list[str] | None, typer.Option(
    "--seed-field", help="Extra seed field NAME=VALUE (repeatable).", show_default=False)]
WorldSizeOpt = Annotated[int | None, typer.Option(
    "--world-size", help="LMCache key field.", show_default=False)]
WorkerIdOpt = Annotated[int | None, typer.Option(
    "--worker-id", help="LMCache key field.", show_default=False)]
TpRankOpt = Annotated[int | None, typer.Option(
    "--tp-rank", help="Tensor-parallel rank (Mooncake keys).", show_default=False)]
KeyFormatOpt = Annotated[str | None, typer.Option(
    "--key-format", help="raw (engine key) or mooncake (Mooncake object key).",
    show_default=False)]
StorePrefixOpt = Annotated[str | None, typer.Option(
    "--store-prefix", help="vLLM Mooncake cache_prefix / SGLang extra_backend_tag.",
    show_default=False)]

_ENGINE = "Engine options"
TpSizeOpt = Annotated[int | None, typer.Option(
    "--tp-size", rich_help_panel=_ENGINE, show_default=False,
    help="Tensor-parallel size (vLLM Mooncake: with --num-kv-heads or --mla, which ranks "
         "share one object).")]
NumKvHeadsOpt = Annotated[int | None, typer.Option(
    "--num-kv-heads", rich_help_panel=_ENGINE, show_default=False,
    help="The model's total KV heads (num_key_value_heads; vLLM Mooncake rank under GQA).")]
MlaOpt = Annotated[bool | None, typer.Option(
    "--mla/--no-mla", rich_help_panel=_ENGINE, show_default=False,
    help="The model uses MLA (vLLM Mooncake rank 0, SGLang Mooncake '__k', LMCache world "
         "size 1).")]
PpRankOpt = Annotated[int | None, typer.Option(
    "--pp-rank", rich_help_panel=_ENGINE, show_default=False,
    help="Pipeline-parallel rank (Mooncake keys of vLLM and SGLang).")]
PpSizeOpt = Annotated[int | None, typer.Option(
    "--pp-size", rich_help_panel=_ENGINE, show_default=False,
    help="Pipeline-parallel size (SGLang Mooncake '_{tp}_{pp}_k' when above 1).")]
UnfullOpt = Annotated[bool | None, typer.Option(
    "--save-unfull-chunk/--no-save-unfull-chunk", rich_help_panel=_ENGINE,
    show_default=False, help="LMCache save_unfull_chunk: the last partial chunk has a key.")]
LayerIdOpt = Annotated[int | None, typer.Option(
    "--layer-id", rich_help_panel=_ENGINE, show_default=False,
    help="LMCache layer-wise mode (use_layerwise): write the keys of this layer.")]
LmcacheHostOpt = Annotated[str | None, typer.Option(
    "--lmcache-host", rich_help_panel=_ENGINE, show_default=False,
    help="What LMCache runs in: vllm (default), or none (SGLang, standalone: NONE_HASH 0, "
         "builtin hash).")]
LoraPathsOpt = Annotated[list[str] | None, typer.Option(
    "--lora-paths", rich_help_panel=_ENGINE, show_default=False,
    help="Adapter NAME=PATH or PATH as the engine was started (SGLang --lora-paths, vLLM "
         "--lora-modules; repeatable): paths for prompts whose lora gives only a name.")]

TokenizerOpt = Annotated[str | None, typer.Option(
    "--tokenizer", help="Tokenizer (path or id) for prompts given as text.",
    show_default=False)]

_STORE = "Live store check"


def _engine_flags(tp_size: int | None, num_kv_heads: int | None, mla: bool | None,
                  pp_rank: int | None, pp_size: int | None, save_unfull_chunk: bool | None,
                  layer_id: int | None, lmcache_host: str | None,
                  lora_paths: list[str] | None) -> dict[str, object]:
    """The engine options as settings flags (``None``: not given on the command line)."""
    return {"tp_size": tp_size, "num_kv_heads": num_kv_heads, "mla": mla, "pp_rank": pp_rank,
            "pp_size": pp_size, "save_unfull_chunk": save_unfull_chunk, "layer_id": layer_id,
            "lmcache_host": lmcache_host,
            "lora_paths": tuple(lora_paths) if lora_paths else None}


def _config(ctx: typer.Context, extra: list[str] | None, **flags: object) -> KeyConfig:
    settings = global_options(ctx).settings(KeysSettings, **flags)
    return config_from_settings(settings, extra_fields=extra or [])


def _checks_table(out: Output, title: str, results: list[CheckResult]) -> None:
    table = Table(title=title)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for r in results:
        table.add_row(r.name, "[green]pass[/green]" if r.passed else "[red]FAIL[/red]",
                      r.detail)
    out.print(table)


@app.callback(invoke_without_command=True)
def verify_keys(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    block_size: BlockSizeOpt = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    tenant: TenantOpt = None,
    kv_dtype: KvDtypeOpt = None,
    kv_layout: KvLayoutOpt = None,
    seed_field: SeedFieldOpt = None,
    tenant_isolation_check: Annotated[bool, typer.Option(
        "--tenant-isolation", help="Also check that two tenants' keys share nothing.")] = False,
    tenants: Annotated[str, typer.Option(
        "--tenants", help="Comma-separated tenants for --tenant-isolation.")] = "tenant-a,tenant-b",
    store: Annotated[str | None, typer.Option(
        "--store", rich_help_panel=_STORE, show_default=False,
        help="Check a live store instead: master HOST:PORT ('' = the local embedded store).")
    ] = None,
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", rich_help_panel=_STORE, show_default=False,
        help="Prompts file (JSON lines) whose blocks to look up with --store.")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", rich_help_panel=_STORE,
        help="Store behind --store: kvctl, or mooncake (a Mooncake master).")] = "kvctl",
    expect_hit: Annotated[float | None, typer.Option(
        "--expect-hit", rich_help_panel=_STORE, show_default=False,
        help="Exit 1 if a prompt's held prefix is below this fraction of its blocks.")
    ] = None,
    lora_name: LoraNameOpt = None,
    lora_path: LoraPathOpt = None,
    world_size: WorldSizeOpt = None,
    worker_id: WorkerIdOpt = None,
    tp_rank: TpRankOpt = None,
    key_format: KeyFormatOpt = None,
    store_prefix: StorePrefixOpt = None,
    tp_size: TpSizeOpt = None,
    num_kv_heads: NumKvHeadsOpt = None,
    mla: MlaOpt = None,
    pp_rank: PpRankOpt = None,
    pp_size: PpSizeOpt = None,
    save_unfull_chunk: UnfullOpt = None,
    layer_id: LayerIdOpt = None,
    lmcache_host: LmcacheHostOpt = None,
    lora_paths: LoraPathsOpt = None,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Self-check the key scheme in use on built-in sample prompts, or (with --store) look
    up a prompts file's blocks in a live store.

    Same prefix gives the same keys; a change at token t changes every key from t's block
    on and none before; a different seed setting changes every key; partial blocks have no
    key. Exit 1 when a check fails.

    With --store ADDR --prompts FILE: per prompt, how many leading blocks the store holds
    (the hit prefix), the first missing block, and blocks held after that gap (evicted, or
    written under other settings). Exit 1 only when --expect-hit is given and missed.

    Example: kvctl verify-keys --profile vllm:sha256_cbor --tenant-isolation

    Example: kvctl verify-keys --store 127.0.0.1:50051 --prompts p.jsonl --expect-hit 0.9
    """
    if ctx.invoked_subcommand is not None:
        return
    out = global_options(ctx).output(json_mode=json_out)
    flags: dict[str, object] = {
        "profile": profile, "block_size": block_size, "model": model, "revision": revision,
        "tenant": tenant, "kv_dtype": kv_dtype, "kv_layout": kv_layout, "lora_name": lora_name,
        "lora_path": lora_path, "world_size": world_size, "worker_id": worker_id,
        "tp_rank": tp_rank, "key_format": key_format, "store_prefix": store_prefix,
        **_engine_flags(tp_size, num_kv_heads, mla, pp_rank, pp_size, save_unfull_chunk,
                        layer_id, lmcache_host, lora_paths)}
    store_only = (store, prompts, expect_hit, tokenizer)
    if any(v is not None for v in store_only) or backend != "kvctl":
        report = _store_check(ctx, store, prompts, backend, expect_hit, seed_field, out,
                              tokenizer=tokenizer, **flags)
        if json_out:
            out.emit_json("keys.store-check", {**vars(report), "ok": report.ok,
                                               "checks": _hit_checks(report)})
        else:
            _render_store_check(out, report)
        if not report.ok:
            raise typer.Exit(int(ExitCode.CHECK_FAILED))
        return
    config = _config(ctx, seed_field, **flags)
    # Engine profiles that write model and dtype into keys need some value to self-check.
    fields = config.fields.replace(model=config.fields.model or "selfcheck-model",
                                   kv_dtype=config.fields.kv_dtype or "bfloat16")
    config = KeyConfig(**{**config.__dict__, "fields": fields})
    results = self_check(config)
    isolation = (tenant_isolation(config, [t.strip() for t in tenants.split(",") if t.strip()])
                 if tenant_isolation_check else [])
    ok = all(r.passed for r in results + isolation)
    if json_out:
        out.emit_json("keys.selfcheck", {"profile": config.profile,
                                         "block_size": config.block_size, "ok": ok,
                                         "checks": _check_entries(results),
                                         "tenant_isolation": _check_entries(isolation)})
    else:
        _checks_table(out, f"key self-check: {config.profile}, block size {config.block_size}",
                      results)
        if isolation:
            _checks_table(out, "tenant isolation", isolation)
    if not ok:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


def _check_entries(results: list[CheckResult]) -> list[dict[str, object]]:
    """Self-check results as verdict entries (``passed``: schema 1's field, deprecated)."""
    return [check_entry(r.name, "pass" if r.passed else "fail", detail=r.detail,
                        passed=r.passed) for r in results]


def _hit_checks(report: StoreCheckReport) -> list[dict[str, object]]:
    """One check per prompt held to ``--expect-hit`` (none without it)."""
    if report.expect_hit is None:
        return []
    return [check_entry(p.prompt, "fail" if p.below_expected else "pass",
                        detail=f"{100 * p.hit_fraction:.0f}% of {p.blocks} block(s) held as a "
                        f"prefix, expected >= {100 * report.expect_hit:g}%")
            for p in report.prompts]


def _store_check(ctx: typer.Context, store: str | None, prompts: Path | None, backend: str,
                 expect_hit: float | None, seed_field: list[str] | None, out: Output,
                 *, tokenizer: str | None, **flags: object) -> StoreCheckReport:
    if store is None or prompts is None:
        raise UsageError("the store check needs both --store ADDR and --prompts FILE",
                         "e.g. kvctl verify-keys --store 127.0.0.1:50051 --prompts p.jsonl "
                         "(--store '' for the local embedded store)")
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    check_expect_hit(expect_hit)
    opts = global_options(ctx)
    config = _config(ctx, seed_field, **flags)
    encode = load_tokenizer(tokenizer) if tokenizer else None
    manifest = emit(config, read_prompts(prompts, tokenizer=encode))
    if not manifest.seed.reproducible:
        out.warn(f"PYTHONHASHSEED is unset and {config.profile} draws a random first link per "
                 "process: no store can hold these keys")
    if backend == "kvctl":
        address = resolve_master(opts.settings(StoreSettings, master=store or None))
    else:
        address = store or opts.settings(StoreSettings).master
    token = opts.settings(CommonSettings).token
    out.debug(f"looking up {sum(len(p.keys) for p in manifest.prompts)} keys in the "
              f"{backend} store at {address}")
    with open_store(backend, address, token=token) as exists:
        return check_store(manifest, exists, backend=backend, store=address,
                           expect_hit=expect_hit)


_VERDICT_STYLE = {Verdict.FULL: "[green]full[/green]", Verdict.PARTIAL: "[yellow]partial[/yellow]",
                  Verdict.MISS: "[red]miss[/red]", Verdict.BROKEN: "[red]broken[/red]",
                  Verdict.EMPTY: "[dim]no full block[/dim]"}


def _render_store_check(out: Output, report: StoreCheckReport) -> None:
    expect = ("" if report.expect_hit is None else
              f", expected hit >= {100 * report.expect_hit:g}%")
    table = Table(title=f"blocks held by the {report.backend} store at {report.store} "
                  f"({report.profile}, block size {report.block_size}, keys "
                  f"{report.key_format}{expect})")
    table.add_column("prompt")
    for col in ("blocks", "held prefix", "hit", "first missing block", "held after gap"):
        table.add_column(col, justify="right")
    table.add_column("verdict")
    for r in report.prompts:
        hit = f"{100 * r.hit_fraction:.0f}%"
        if r.below_expected:
            hit = f"[red]{hit}[/red]"
        missing = "-" if r.first_missing_block is None else str(r.first_missing_block)
        table.add_row(r.prompt, str(r.blocks), str(r.held_prefix), hit, missing,
                      str(r.held_after_gap), _VERDICT_STYLE[r.verdict])
    out.print(table)
    broken = [r for r in report.prompts if r.verdict is Verdict.BROKEN]
    if broken:
        out.print(f"{len(broken)} prompt(s) have blocks held after a missing one: prefix "
                  "matching stops at the gap. The missing block was evicted, or the rest was "
                  "written by an instance whose keys differ from these settings (compare "
                  "manifests with 'kvctl verify-keys emit' and 'compare').")
    out.print(f"{plural(report.keys_checked, 'key')} looked up in "
              f"{plural(report.exists_calls, 'request')}; "
              f"settings fingerprint {report.fingerprint}.")


@app.command("profiles")
def profiles(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """List the key profiles: kvctl's own and the engines' reproduced schemes.

    Example: kvctl verify-keys profiles
    """
    out = global_options(ctx).output(json_mode=json_out)
    rows = [
        {"name": p.name, "engine": p.engine, "engine_version": p.engine_version,
         "default_block_size": p.default_block_size, "mixes": sorted(p.mixes),
         "mooncake_key": bool(p.mooncake_mixes), "seed": p.seed_doc}
        for p in known_profiles().values()
    ]
    if json_out:
        out.emit_json("keys.profiles", {"profiles": rows})
        return
    table = Table(title="key profiles")
    for col in ("profile", "engine", "block", "mixes into keys", "how the seed is built"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["name"]), f"{r['engine']} {r['engine_version']}",
                      str(r["default_block_size"]), ", ".join(r["mixes"]),  # type: ignore[arg-type]
                      str(r["seed"]))
    out.print(table)


@app.command("emit")
def emit_cmd(
    ctx: typer.Context,
    prompts: Annotated[Path, typer.Option("--prompts", help="Prompts file (JSON lines).")],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="Manifest file to write (default: print it).",
        show_default=False)] = None,
    profile: ProfileOpt = None,
    block_size: BlockSizeOpt = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    tenant: TenantOpt = None,
    kv_dtype: KvDtypeOpt = None,
    kv_layout: KvLayoutOpt = None,
    lora_name: LoraNameOpt = None,
    lora_path: LoraPathOpt = None,
    seed_field: SeedFieldOpt = None,
    world_size: WorldSizeOpt = None,
    worker_id: WorkerIdOpt = None,
    tp_rank: TpRankOpt = None,
    key_format: KeyFormatOpt = None,
    store_prefix: StorePrefixOpt = None,
    tp_size: TpSizeOpt = None,
    num_kv_heads: NumKvHeadsOpt = None,
    mla: MlaOpt = None,
    pp_rank: PpRankOpt = None,
    pp_size: PpSizeOpt = None,
    save_unfull_chunk: UnfullOpt = None,
    layer_id: LayerIdOpt = None,
    lmcache_host: LmcacheHostOpt = None,
    lora_paths: LoraPathsOpt = None,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Write this instance's key manifest: settings fingerprint + every prompt's keys.

    PYTHONHASHSEED is read from the environment exactly as the engine reads it.

    Example: kvctl verify-keys emit --profile vllm:sha256_cbor --prompts p.jsonl -o host-a.json
    """
    out = global_options(ctx).output(json_mode=json_out)
    config = _config(ctx, seed_field, profile=profile, block_size=block_size, model=model,
                     revision=revision, tenant=tenant, kv_dtype=kv_dtype, kv_layout=kv_layout,
                     lora_name=lora_name, lora_path=lora_path, world_size=world_size,
                     worker_id=worker_id, tp_rank=tp_rank, key_format=key_format,
                     store_prefix=store_prefix,
                     **_engine_flags(tp_size, num_kv_heads, mla, pp_rank, pp_size,
                                     save_unfull_chunk, layer_id, lmcache_host, lora_paths))
    encode = load_tokenizer(tokenizer) if tokenizer else None
    manifest = emit(config, read_prompts(prompts, tokenizer=encode))
    if not manifest.seed.reproducible:
        out.warn(f"PYTHONHASHSEED is unset and {config.profile} draws a random first link per "
                 "process: these keys cannot match any other process")
    if output is None:  # the manifest itself is the result: print it as JSON either way
        out.write_json(manifest_to_json(manifest))
        return
    write_manifest(manifest, output)
    summary = {"path": str(output), "fingerprint": manifest.fingerprint,
               "profile": config.profile, "prompts": len(manifest.prompts),
               "keys": sum(len(p.keys) for p in manifest.prompts),
               "seed_source": manifest.seed.source}
    if json_out:
        out.emit_json("keys.emit", summary)
    else:
        out.print(f"wrote {output}: {plural(len(manifest.prompts), 'prompt')}, "
                  f"{plural(sum(len(p.keys) for p in manifest.prompts), 'key')}, "
                  f"profile {config.profile}, fingerprint {manifest.fingerprint}")


def _render_comparison(out: Output, result: Comparison, manifests: list[Manifest]) -> None:
    table = Table(title="key manifests")
    for col in ("manifest", "profile", "block", "fingerprint", "seed"):
        table.add_column(col)
    for m in manifests:
        table.add_row(Path(m.source).name, m.config.profile, str(m.config.block_size),
                      m.fingerprint, m.seed.source)
    out.print(table)
    table = Table(title="per prompt")
    for col in ("prompt", "pair", "result", "first diverging block", "why"):
        table.add_column(col)
    for r in result.results:
        verdict = {"match": "[green]match[/green]", "mismatch": "[red]MISMATCH[/red]",
                   "missing": "[red]MISSING[/red]"}[r.status]
        why = "; ".join(f"{c.setting}: {c.a} vs {c.b} ({c.detail})" for c in r.causes)
        if r.hazards:
            why = "; ".join(f"[yellow]hazard[/yellow] {c.setting}: {c.a} vs {c.b} ({c.detail})"
                            for c in r.hazards)
        if r.status == "missing":
            why = "prompt is in one manifest only"
        first = "" if r.first_diverging_block is None else str(r.first_diverging_block)
        table.add_row(r.prompt, f"{Path(r.a).name} / {Path(r.b).name}", verdict, first, why)
    out.print(table)


def _comparison_detail(r: PairResult) -> str:
    if r.status == "missing":
        return "the prompt is in one manifest only"
    if r.status == "match":
        return f"{r.blocks_a} key(s) match"
    why = "; ".join(c.detail for c in r.causes)
    return f"keys differ from block {r.first_diverging_block} on" + (f": {why}" if why else "")


@app.command("compare")
def compare_cmd(
    ctx: typer.Context,
    manifests: Annotated[list[Path], typer.Argument(help="Two or more manifests.")],
    json_out: JsonOpt = False,
) -> None:
    """Compare manifests: first diverging block per prompt and pair, and why.

    Exit 1 on any mismatch.

    Example: kvctl verify-keys compare host-a.json host-b.json
    """
    out = global_options(ctx).output(json_mode=json_out)
    loaded = [read_manifest(p) for p in manifests]
    result = compare(loaded)
    if json_out:
        checks = [check_entry(f"{r.prompt}: {r.a} / {r.b}",
                              "pass" if r.status == "match" else "fail",
                              detail=_comparison_detail(r)) for r in result.results]
        out.emit_json("keys.compare", {"ok": result.ok, "checks": checks,
                                       "instances": result.instances,
                                       "results": result.results})
    else:
        _render_comparison(out, result, loaded)
    if not result.ok:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


# ---------------------------------------------------------------- watch

_WATCH = "Watch"


def _line_emit_json(kind: str, payload: dict[str, object]) -> None:
    """One ``--json`` document on one line of stdout (a watch prints many: JSON lines)."""
    import json
    import sys

    from kvctl.output import json_document, to_jsonable

    sys.stdout.write(json.dumps(to_jsonable(json_document(kind, payload)),
                                separators=(",", ":")) + "\n")
    sys.stdout.flush()


@app.command("watch")
def watch_cmd(
    ctx: typer.Context,
    endpoints: Annotated[list[str], typer.Argument(
        help="Publishers as [NAME=]URL[,replay=URL][,bind]: vLLM/SGLang --kv-events-config "
             "endpoint (tcp://HOST:PORT, ipc://PATH) and its replay_endpoint.",
        show_default=False)],
    profile: ProfileOpt = None,
    block_size: BlockSizeOpt = None,
    lora_name: LoraNameOpt = None,
    lora_path: LoraPathOpt = None,
    lora_paths: LoraPathsOpt = None,
    pythonhashseed: Annotated[str | None, typer.Option(
        "--pythonhashseed", show_default=False,
        help="The engines' PYTHONHASHSEED (default: this environment's, unset if unset).")
    ] = None,
    record: Annotated[Path | None, typer.Option(
        "--record", rich_help_panel=_WATCH, show_default=False,
        help="Write every message received to FILE (JSON lines; replay it with 'kvctl sim "
             "trace --format kv-events FILE').")] = None,
    duration: Annotated[float | None, typer.Option(
        "--duration", rich_help_panel=_WATCH, show_default=False,
        help="Stop after this many seconds (default: until Ctrl-C or q).")] = None,
    events: Annotated[int | None, typer.Option(
        "--events", rich_help_panel=_WATCH, show_default=False,
        help="Stop after this many KV events, every instance together.")] = None,
    window: Annotated[float, typer.Option(
        "--window", rich_help_panel=_WATCH,
        help="Seconds of the windowed pool figures.")] = 60.0,
    max_blocks: Annotated[int, typer.Option(
        "--max-blocks", rich_help_panel=_WATCH,
        help="Blocks remembered per instance (memory bound; the oldest are forgotten).")
    ] = 1_000_000,
    interval: Annotated[float, typer.Option(
        "--interval", rich_help_panel=_WATCH,
        help="Seconds between refreshes of the view (and --json summary lines).")] = 1.0,
    replay_timeout: Annotated[float, typer.Option(
        "--replay-timeout", rich_help_panel=_WATCH,
        help="Seconds one replay of a sequence gap may take.")] = 5.0,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", rich_help_panel=_WATCH, show_default=False,
        help="Serve Prometheus counters on this port (0 picks a free one).")] = None,
    metrics_host: Annotated[str, typer.Option(
        "--metrics-host", rich_help_panel=_WATCH, help="Address of the metrics endpoint.")
    ] = "127.0.0.1",
    json_out: JsonOpt = False,
) -> None:
    """Watch live KV events of engine instances: hashes recomputed with the profile, blocks
    hashed differently across instances, and what a shared pool would save.

    Each BlockStored's hashes are recomputed from its tokens, parent and extra keys; a
    mismatch names the instance and the likely cause. Int hashes are truncated digests, so a
    chain is verifiable from its root only: blocks kvctl cannot check are counted with the
    reason. Sequence gaps are filled from the replay endpoint. With --json: one
    keys.watch-finding line per finding, a keys.watch line every --interval and a final one.
    Exit 1 when hashes mismatch, instances diverge, or an endpoint never answered.

    Example: kvctl verify-keys watch a=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558

    Example: kvctl verify-keys watch tcp://127.0.0.1:5557 --duration 60 --json --record kv.jsonl
    """
    import collections
    import os
    import sys

    from kvctl.commands._common import stop_on_signal
    from kvctl.keys.watch.checker import Finding
    from kvctl.keys.watch.session import (
        WatchOptions,
        WatchSession,
        finding_json,
        serve_metrics,
    )
    from kvctl.keys.watch.source import parse_endpoint

    out = global_options(ctx).output(json_mode=json_out)
    settings = global_options(ctx).settings(
        KeysSettings, profile=profile, block_size=block_size, lora_name=lora_name,
        lora_path=lora_path, lora_paths=tuple(lora_paths) if lora_paths else None)
    env = dict(os.environ)
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    config = config_from_settings(settings, env=env)
    parsed = [parse_endpoint(e) for e in endpoints]
    for name, value in (("--window", window), ("--interval", interval),
                        ("--replay-timeout", replay_timeout), ("--max-blocks", max_blocks),
                        ("--duration", duration), ("--events", events)):
        if value is not None and value <= 0:
            raise UsageError(f"{name} {value:g} is not positive", f"give {name} above 0")
    options = WatchOptions(duration_s=duration, max_events=events, window_s=window,
                           max_blocks=max_blocks, replay_timeout_s=replay_timeout)
    live = not json_out and sys.stdout.isatty()
    recent: collections.deque[Finding] = collections.deque(maxlen=8)

    def found(f: Finding) -> None:
        if json_out:
            _line_emit_json("keys.watch-finding", finding_json(f))
        elif live:
            recent.append(f)
        elif f.severity == "info":
            out.info(f.message)
        else:
            out.warn(f.message)

    from kvctl.commands._keys_watch_screen import render, watch_live

    with stop_on_signal() as stop, WatchSession(parsed, config, options, on_finding=found,
                                                record=record) as session:
        metrics = (serve_metrics(session, metrics_host, metrics_port)
                   if metrics_port is not None else None)
        if metrics is not None and metrics.address is not None:
            out.info(f"metrics on http://{metrics.address[0]}:{metrics.address[1]}/metrics")
        out.info(f"watching {', '.join(e.name for e in parsed)} with {config.profile}, "
                 f"block size {config.block_size}; Ctrl-C stops")
        try:
            if live:
                watch_live(session, recent, interval_s=interval, console=out.console,
                           stop=stop)
            else:
                tick = ((lambda: _line_emit_json("keys.watch", session.summary()))
                        if json_out else None)
                session.run(stop, tick_s=interval, on_tick=tick)
        finally:
            if metrics is not None:
                metrics.close()
        doc = session.summary(final=True)
    if json_out:
        _line_emit_json("keys.watch", doc)
    else:
        out.print(render(doc, list(recent)))
        if record is not None:
            out.info(f"recorded to {record}")
    if not doc["ok"]:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))
