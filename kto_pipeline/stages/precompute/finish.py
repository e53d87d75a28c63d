"""The end of a precompute: `finish` records the segment's shards and the run's timing in one atomic manifest write
(a full precompute marks the cache complete, an append adds its segment) and prints the summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kto_pipeline.cache import write_manifest
from kto_pipeline.cache.manifest import Manifest
from kto_pipeline.runtime.peak_memory import describe
from kto_pipeline.stages.precompute.phases import Pass


def finish(run: Pass) -> None:
    """Record the segment's shards and this run's timing; a full precompute marks the cache complete, an append adds
    its segment to the cache (one atomic manifest write). Print the summary."""
    config, prepared, progress, output = run.config, run.prepared, run.progress, run.output
    peak_memory = run.peaks.per_process(run.state)
    if run.state.is_main_process:
        timing = {
            "preprocess_seconds": round(prepared.seconds, 3),
            "preprocess_cached": prepared.cached,
            "preprocess_rows_per_second": round(prepared.source_rows / max(prepared.seconds, 1e-9), 1),
            "tokenize_seconds": round(prepared.tokenize_seconds, 3),
            "num_proc": config.num_proc,
            "reference_pass_seconds": round(time.perf_counter() - progress.started, 3),
            "rows_scored": progress.rows_scored,
            "tokens_scored": progress.tokens_scored,
            "tokens_executed": progress.tokens_executed,
            "tokens_needed": progress.tokens_needed,
            "token_efficiency": round(progress.tokens_needed / max(progress.tokens_executed, 1), 4),
            "forwards": progress.forwards,
            "forward_tokens": run.reference.forward_tokens,
            "wall_seconds": round(time.perf_counter() - run.started, 3),
            "processes": run.state.num_processes,
            "peak_memory": peak_memory,
        }
        if run.reference.plan.compiled:
            timing["compile"] = run.reference.plan.compiled.report()
        segment = output.segment
        segment["shards"] = [s["file"] for s in output.written]
        segment["timing"] = timing
        if run.base is None:
            output.manifest.mark_complete(timing)
        else:
            output.manifest.finish_append()
        write_manifest(run.out, output.manifest)
        _print_summary(output.manifest, segment, run.out, time.perf_counter() - run.started)
    run.engine.close(run.reference.scorer)
    run.state.wait_for_everyone()


def _print_summary(manifest: Manifest, segment: dict[str, Any], out: Path, seconds: float) -> None:
    timing, dropped = segment["timing"], segment["dropped"]
    dropped_text = ", ".join(f"{c} ({r})" for r, c in dropped.items()) if dropped else "none"
    cached = " (read from the datasets cache)" if timing["preprocess_cached"] else ""
    counts = manifest.counts
    appended = segment["index"] > 0
    rows = (
        f"{segment['rows']} appended as segment {segment['index']} ({segment['desirable']} desirable, "
        f"{segment['rows'] - segment['desirable']} undesirable); {segment['matched_rows']} of the dataset's rows "
        f"were in the cache already; the cache now holds {counts['rows']} rows in {len(manifest.segments)} segments"
        if appended
        else f"{counts['rows']} ({counts['desirable']} desirable, {counts['undesirable']} undesirable)"
    )
    scored_what = "completions + KL completions" if manifest.has_kl else "chosen + rejected completions, no KL"
    pairs = segment.get("pairs") or {}
    pairs_line = (
        f"  pairs        {pairs['complete']} (chosen, rejected) pairs, {pairs['rows_without_partner']} rows without "
        "their partner\n"
        if pairs.get("complete") or pairs.get("rows_without_partner")
        else ""
    )
    print(
        f"\n{'append' if appended else 'precompute'} finished\n"
        f"  rows         {rows}\n"
        f"{pairs_line}"
        f"  dropped      {sum(dropped.values())}: {dropped_text}\n"
        f"  tokens       {timing['tokens_scored']} scored ({scored_what}, with their prompts)\n"
        f"  efficiency   {timing['token_efficiency']:.1%}: {timing['tokens_needed']} tokens needed (each prompt once, "
        f"no padding) / {timing['tokens_executed']} executed\n"
        f"  forwards     {timing['forwards']}: {timing['tokens_executed'] / max(timing['forwards'], 1):.0f} tokens "
        f"each on average, up to {timing['forward_tokens']}\n"
        f"  tokenizing   {segment['normalized_rows']} rows of {segment['source']['source_rows']} source rows in "
        f"{timing['preprocess_seconds']:.1f} s: {timing['preprocess_rows_per_second']:.0f} source rows/s (load, "
        f"check, key, tokenize; datasets.map {timing['tokenize_seconds']:.1f} s with --num-proc "
        f"{timing['num_proc']}){cached}\n"
        f"  reference    {timing['rows_scored']} rows in {timing['reference_pass_seconds']:.1f} s: "
        f"{timing['rows_scored'] / max(timing['reference_pass_seconds'], 1e-9):.1f} rows/s, "
        f"{timing['tokens_scored'] / max(timing['reference_pass_seconds'], 1e-9):.0f} tokens/s\n"
        f"  wall time    {seconds:.1f} s\n"
        f"  memory       peak private host memory: {describe(timing['peak_memory'])}\n"
        f"  shards       {len(manifest.shards)}\n"
        f"  cache        {out.resolve()}",
        flush=True,
    )
