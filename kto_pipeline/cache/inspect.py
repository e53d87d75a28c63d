"""`kto-pipeline inspect`: what a cache holds, as readable tables."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kto_pipeline.cache import check_cache, read_manifest


def _kv_table(title: str, items: dict) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in items.items():
        table.add_row(str(k), "-" if v is None else str(v))
    return table


def pairs_text(m) -> str:
    """The counts table's pairs line: whether DPO-family losses can train on the cache."""
    if m.format_version == 1:
        return "not recorded (format version 1: precompute again to train pair losses)"
    pairs = m.pairs
    if not pairs["complete"] and not pairs["rows_without_partner"]:
        return "none (unpaired data: KTO only)"
    return f"{pairs['complete']} complete, {pairs['rows_without_partner']} rows without their partner in the cache"


def inspect_cache(cache_dir: str | Path, verify: bool = False, console: Console | None = None) -> list[str]:
    """Print the manifest of a cache as tables (its segments too) and return its problems (cheap checks, or all with
    `verify`: every shard's and keys file's sha256)."""
    console = console or Console()
    cache_dir = Path(cache_dir)
    m = read_manifest(cache_dir)
    status = "complete" if m.complete else "INCOMPLETE (re-run precompute to finish)"
    console.print(f"[bold]cache[/bold] {cache_dir.resolve()}  format v{m.format_version}  {status}")
    reference = dict(m.reference)
    if reference.get("quantization"):
        from kto_pipeline.quantization import Quantization

        reference["quantization"] = Quantization.describe(reference["quantization"])
    console.print(_kv_table("reference model", reference))
    console.print(_kv_table("tokenizer", m.tokenizer))
    console.print(_kv_table("dataset", m.dataset))
    console.print(_kv_table("settings", m.settings))
    counts = dict(m.counts)
    dropped = counts.pop("dropped")
    counts["dropped"] = ", ".join(f"{c} ({r})" for r, c in dropped.items()) or "none"
    counts["pairs"] = pairs_text(m)
    counts["KL completions"] = "yes" if m.has_kl else "none (precompute --pairs-only: pair losses only, not KTO)"
    console.print(_kv_table("counts", counts))
    shards = Table(title="shards", title_justify="left")
    for col in ("file", "rows", "bytes", "sha256"):
        shards.add_column(col)
    for s in m.shards:
        shards.add_row(s["file"], str(s["rows"]), str(s["bytes"]), s["sha256"][:16] + "...")
    console.print(shards)
    if m.segments:
        console.print("[italic]segments[/italic]")
        for seg in m.segments:
            first, count, files = seg["first_example_id"], seg["normalized_rows"], seg["shards"]
            held = f", {seg['matched_rows']} rows of its data already held" if seg["index"] else ""
            pairs = seg.get("pairs") or {}
            if pairs.get("complete") or pairs.get("rows_without_partner"):
                held += f", {pairs['complete']} pairs ({pairs['rows_without_partner']} rows without their partner)"
            console.print(
                f"  {seg['index']}  {seg['rows']} rows{held}  example ids {first}..{first + count - 1}  "
                f"{files[0]}..{Path(files[-1]).name}  written {seg.get('written_at') or '-'}\n"
                f"     from {seg['source']['name_or_path']} ({seg['source']['content_hash']})",
                overflow="fold",
                highlight=False,
            )
    if m.images is not None:
        console.print(_kv_table("images (not held: read from the dataset)", m.images))
    problems = check_cache(cache_dir, m, full=verify)
    if verify and m.images is not None and not problems:
        from kto_pipeline.cache import open_cache
        from kto_pipeline.errors import KTOPipelineError
        from kto_pipeline.images import ImageRows

        try:  # every row's images read again and hashed
            problems = ImageRows.of_cache(m).problems(open_cache(cache_dir).table)
        except KTOPipelineError as exc:
            problems = [str(exc)]
    return problems
