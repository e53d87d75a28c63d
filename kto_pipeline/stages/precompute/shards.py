"""The files a precompute writes: its segment's keys file, the shards the reference pass scores, the manifest.

Rows are scored a shard at a time (`shard_size` kept rows, in example-id order), so that a crash loses at most one
shard of work and a rerun resumes after the intact ones (`finished_shards`; `remove_leftovers` deletes the rest).
Within a shard each row is one tree, its prompt followed by its completion and its KL completion, which both
attend to the prompt (`scoring/packing.py`); with --pairs-only each pair is one tree, its prompt followed by its
two answers. Either way the prompt runs once and every tree has two continuations: one path builds, scores and
lays out both (`_score_rows`, `_columns`). Shards are scored in rounds, one per process; each is written by a
background writer while the next round's forwards run, and once a round's shards are written the main process
records them, so the manifest always lists a complete prefix of them; `finish` records the segment and the timing
in one atomic manifest write (`finish.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object

from kto_pipeline.cache import SCHEMA, SHARD_DIR, completion_room, token_sum, write_manifest, write_shard
from kto_pipeline.errors import KTOPipelineError, Preempted
from kto_pipeline.files import sha256_file
from kto_pipeline.runtime.launch import print0
from kto_pipeline.runtime.preemption import StopRequests, continue_command
from kto_pipeline.scoring.logprobs import ReferenceScorer, score_shard
from kto_pipeline.scoring.packable import PACKING_LEAKED
from kto_pipeline.scoring.packing import Tree
from kto_pipeline.stages.precompute.phases import Pass, PreparedRows, ShardProgress, ShardStats
from kto_pipeline.stages.precompute.segments import KEY_DIR, key_array, new_segment, open_keys, write_keys

# ------------------------------------------------------------------------------------ what --output holds


def finished_shards(out: Path, shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading shards of an interrupted run that are intact (present, same sha256): resume after them."""
    good = []
    for shard in shards:
        path = out / shard["file"]
        if not path.exists() or sha256_file(path) != shard["sha256"]:
            print(f"{shard['file']} is missing or altered: it and the shards after it are computed again")
            break
        good.append(shard)
    return good


def remove_leftovers(out: Path, keep: set[str]) -> None:
    """Delete the files under shards/ and keys/ that are not part of the cache: half-written files of a killed
    run, and finished files that no manifest entry lists."""
    for folder in (SHARD_DIR, KEY_DIR):
        for leftover in out.glob(f"{folder}/*"):
            if f"{folder}/{leftover.name}" not in keep:
                leftover.unlink()


def segment_entry(run: Pass, index: int, format_version: int | None) -> dict[str, Any]:
    """Write the keys file of the segment this run writes (main process) and return its manifest entry.
    `format_version`: the cache's (an append to a version-1 cache keeps its format: no pairs)."""
    prepared, kl_seed = run.prepared, run.config.kl_seed
    keys = key_array(open_keys(prepared.key_files).column("key"))
    if prepared.key_rows is not None:
        keys = keys[prepared.key_rows]
    first = prepared.segment.first_example_id
    kept = np.zeros(len(keys), dtype=bool)
    kept[prepared.example_ids - first] = True
    keys_entry = write_keys(run.out, index, first + np.arange(len(keys)), keys, kept)
    rows = replace(prepared.segment, pairs=None) if format_version == 1 else prepared.segment
    if prepared.outside_partner is None:
        kl = {"rule": "seeded cycle through the segment's rows", "seed": [kl_seed, index] if index else [kl_seed]}
    else:
        kl = {"rule": "drawn from the cache's rows of the same prompt kind", "seed": [kl_seed, index]}
    return new_segment(index, **asdict(rows), kl=kl, keys=keys_entry)


# ------------------------------------------------------------------------------------------ scoring


def score_shards(run: Pass) -> None:
    """Score the shards not yet written, in rounds: in round r, process k scores shard r * N + k. A shard is
    written by a background writer while the next round's forwards run; once it is, the main process records it,
    so the manifest always lists a complete prefix of the shards and the shard layout (which rows go where) does
    not depend on the number of processes. An append's shards are numbered after the cache's and recorded under
    `appending` until `finish`."""
    config, state, written = run.config, run.state, run.output.written
    n = len(run.prepared.rows)
    pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    num_shards = (n + config.shard_size - 1) // config.shard_size
    run.progress = progress = ShardProgress(n, sum(s["rows"] for s in written), state)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="kto-pipeline-writer") as writer, StopRequests() as stop:
            writing = None  # the last round's shard, being written
            for first in range(len(written), num_shards, state.num_processes):
                scored = _score_round(run, first, num_shards, pad_id, writer)
                _record(run, writing)
                writing = scored
                signal_name = stop.agreed(state.device)  # one small collective per round
                if signal_name:
                    _record(run, writing)
                    writing = None
                if signal_name and len(written) < num_shards:
                    progress.bar.close()
                    run.engine.close(run.reference.scorer)
                    raise Preempted(
                        f"{signal_name} received: stopped after the shards in flight, {len(written)}/{num_shards} "
                        f"shards written in {run.out}. Continue with {continue_command()}: it resumes after them."
                    )
            _record(run, writing)
    except KeyboardInterrupt:
        progress.bar.close()
        raise KTOPipelineError(
            f"interrupted: {len(written)}/{num_shards} shards are safely written in {run.out}. "
            "Run the same command again to resume from there."
        ) from None
    progress.bar.close()


def _score_round(run: Pass, first: int, num_shards: int, pad_id: int, writer: ThreadPoolExecutor) -> Future:
    """One round: process k scores shard `first + k` and hands it to `writer`; returns the write's future, whose
    result is the shard's manifest entry (None where this process had no shard) and its `ShardStats`."""
    state, progress, output = run.state, run.progress, run.output
    shard_index = first + state.process_index
    progress.executed_here = progress.forwards_here = 0
    if shard_index >= num_shards:
        if run.engine.collective_forwards:  # no shard left for this process: it still runs the others' forwards
            _score_trees(run, [], pad_id)
        done: Future = Future()
        done.set_result((None, ShardStats()))
        return done
    size, n = run.config.shard_size, len(run.prepared.rows)
    positions = np.arange(shard_index * size, min(n, (shard_index + 1) * size))
    columns, trees = _score_rows(run, positions, pad_id)
    needed, scored = _tree_tokens(trees)
    stats = ShardStats(len(positions), scored, progress.executed_here, needed, progress.forwards_here)

    def write() -> tuple[dict[str, Any], ShardStats]:
        shard = output.first_shard + shard_index
        return write_shard(run.out, shard, columns(), output.manifest.format_version), stats

    return writer.submit(write)


def _record(run: Pass, writing: Future | None) -> None:
    """Wait for a round's shards to be written (every process's), then the main process records them."""
    if writing is None:
        return
    state, output = run.state, run.output
    entry, stats = writing.result()
    entries = gather_object([(entry, stats)]) if state.num_processes > 1 else [(entry, stats)]
    if state.is_main_process:
        output.written.extend(sorted((e for e, _ in entries if e is not None), key=lambda e: e["file"]))
        write_manifest(run.out, output.manifest)
    run.progress.end_round([s for _, s in entries])


# the packing check (`check_packing`): the rows it scores both ways, and the most a token's log-prob may move between
# a packed layout and the sequence alone, relative to 1 + its size, by the dtype the check computes in: SmolLM2-135M
# on 8 HH-RLHF rows moved by up to 6.3e-6 in float32 and 7.5e-2 in bf16 weights (rounding, no leak), measured
PACKING_CHECK_ROWS = 8
PACKING_TOLERANCE = {"float32": 1e-4, "half": 2**-2}


def check_packing(run: Pass) -> None:
    """Before trusting a packed layout: the pass's first rows (PACKING_CHECK_ROWS), scored packed as the pass will
    score them and each sequence alone, padded. A difference beyond float rounding (`PACKING_TOLERANCE` of the dtype
    the check computes in) means something in the model carries state from one sequence of a row to the next (a layer
    the static check did not recognise): the whole pass then runs padded, says so, and the manifest records why
    (`prefix_shared: false`, `unshared_because`). Every process checks the same rows (the same forwards)."""
    if (
        run.reference.plan.padded_because is not None
        or run.prepared.image_rows is not None
        or not len(run.prepared.rows)
    ):
        return
    pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    positions = np.arange(min(PACKING_CHECK_ROWS, len(run.prepared.rows)))
    if run.config.pairs_only:
        positions = positions[: len(positions) // 2 * 2]
    trees, _ = _trees(run, positions)
    # the model's structure is what is checked, not a precision: in its weights' dtype without autocast (half
    # precision rounds a token's log-prob by more than a subtle leak moves it), eagerly (compiled layers would compile
    # the check's shapes too); a sharded model's forwards are collective: through its scorer, as the pass runs it
    plan, collective = run.reference.plan, run.engine.collective_forwards
    scorer = run.reference.scorer if collective else ReferenceScorer(run.reference.model, plan.attention)
    regime = plan.regime
    half = regime.weights != "float32" or (collective and regime.autocast is not None)
    scored = {}
    for packed in (True, False):
        with torch.compiler.set_stance("force_eager"), torch.autocast(run.state.device.type, enabled=False):
            scored[packed] = score_shard(
                scorer,
                trees,
                pad_id,
                run.config.batch_size,
                run.reference.forward_tokens,
                run.state.device,
                packed=packed,
                agree_on_forwards=run.engine.agree_on_forwards if collective else None,
            )
    tolerance = PACKING_TOLERANCE["half" if half else "float32"]
    worst = 0.0  # the largest difference of a token's log-prob, relative to 1 + its size
    for packed_tree, alone_tree in zip(scored[True], scored[False], strict=True):
        for packed_values, alone_values in zip(packed_tree, alone_tree, strict=True):
            a, b = np.asarray(packed_values, dtype=np.float64), np.asarray(alone_values, dtype=np.float64)
            if len(a):
                worst = max(worst, float((np.abs(a - b) / (1 + np.abs(b))).max()))
    if worst > tolerance:
        why = (
            f"{PACKING_LEAKED}: by up to {worst:.1e} (relative) against each scored alone, over the first "
            f"{len(trees)} rows; something in the model carries state from one sequence of a row to the next"
        )
        run.reference.plan = plan.padded(why)
        print0(run.state, f"note: {why}; each sequence runs on its own, padded")


def _score_rows(run: Pass, positions: np.ndarray, pad_id: int) -> tuple[Callable[[], dict[str, list]], list[Tree]]:
    """Build and score the trees of the kept rows at `positions`; returns what makes their shard's columns (run by
    the writer) and the trees."""
    prepared = run.prepared
    ids, pair_ids = prepared.example_ids[positions], prepared.pair_ids[positions]
    trees, kl_ids = _trees(run, positions)
    images = None
    if prepared.image_rows is not None:  # each tree's prompt holds its row's images (a pair's: both rows' own)
        image_rows = prepared.rows.take(positions, "source_row")
        tree_rows = image_rows[:: 2 if run.config.pairs_only else 1]
        images = lambda tree: prepared.image_rows.pixels(tree_rows[tree])  # noqa: E731
    scores = _score_trees(run, trees, pad_id, images)
    labels = prepared.rows.labels[positions]
    more = {}
    if prepared.image_rows is not None:
        more = {"image_row": image_rows, "image_hashes": prepared.rows.take(positions, "image_hashes")}
    return lambda: _columns(ids, labels, pair_ids, trees, scores, kl_ids) | more, trees


def _trees(run: Pass, positions: np.ndarray) -> tuple[list[Tree], Any]:
    """The trees of the kept rows at `positions`, and their KL partners' example ids (None with --pairs-only).

    Each row is one tree: its prompt, then its completion and its KL completion. With --pairs-only the rows are
    whole pairs, each (chosen, rejected) next to each other, and each pair is one tree: its prompt, then both
    answers (its rows get no KL completion)."""
    prepared, max_length = run.prepared, run.config.max_length
    ids, pair_ids = prepared.example_ids[positions], prepared.pair_ids[positions]
    prompts, completions = prepared.rows.take(positions, "prompt_ids"), prepared.rows.take(positions, "completion_ids")
    if run.config.pairs_only:
        trees, kl_ids = [], None
        for j in range(0, len(positions), 2):
            if pair_ids[j] != ids[j + 1] or prompts[j] != prompts[j + 1]:
                raise AssertionError(f"rows {ids[j]} and {ids[j + 1]} are not one pair")  # (shards hold whole pairs)
            trees.append(_tree(prompts[j], completions[j], completions[j + 1], max_length))
    else:
        kl_ids, kl_completions = _kl_completions(prepared, positions)
        trees = [_tree(*row, max_length) for row in zip(prompts, completions, kl_completions, strict=True)]
    return trees, kl_ids


def _tree(prompt: list[int], first: list[int], second: list[int], max_length: int) -> Tree:
    """A prompt and its two continuations, each cut to the room the prompt leaves (`completion_room`)."""
    room = completion_room(prompt, max_length)
    return prompt, [first[:room], second[:room]]


def _kl_completions(prepared: PreparedRows, positions: np.ndarray) -> tuple[Any, list[list[int]]]:
    """The KL partners' example ids and completions of the kept rows at `positions`."""
    if prepared.outside_partner is None:
        partners = prepared.partners[positions]
        return prepared.example_ids[partners], prepared.rows.take(partners, "completion_ids")
    return [prepared.outside_partner[0]], [prepared.outside_partner[1]]  # a one-row append: a row of the cache


def _columns(ids, labels, pair_ids, trees: list[Tree], scores: list[tuple[np.ndarray, ...]], kl_ids) -> dict:
    """A shard's columns, one row at a time after checking its reference values are finite. With `kl_ids`, row i
    is tree i's first continuation, its KL completion the second (of row kl_ids[i]). Without (--pairs-only), row i
    is continuation i % 2 of tree i // 2, its KL partner -1 and its KL columns empty (their sum 0)."""
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    per_tree = 1 if kl_ids is not None else 2
    for row, example_id in enumerate(ids):
        (prompt, answers), values = trees[row // per_tree], scores[row // per_tree]
        answer = row % per_tree
        kl_id, kl_completion, kl_values = (kl_ids[row], answers[1], values[1]) if kl_ids is not None else (-1, (), ())
        for what, got in (("completion", values[answer]), ("KL completion", kl_values)):
            got = np.asarray(got, dtype=np.float32)
            if not np.isfinite(got).all():
                raise KTOPipelineError(
                    f"example {int(example_id)}: the reference model gave a non-finite log-prob for its {what} "
                    f"(values {got[~np.isfinite(got)][:3]}). The model or its dtype is broken "
                    "(try --dtype float32); nothing of this row was written."
                )
        cols["example_id"].append(int(example_id))
        cols["label"].append(bool(labels[row]))
        cols["prompt_ids"].append(prompt)
        cols["completion_ids"].append(answers[answer])
        cols["kl_example_id"].append(int(kl_id))
        cols["kl_completion_ids"].append(list(kl_completion))
        cols["ref_logp"].append(token_sum(values[answer]))
        cols["ref_kl_logp"].append(token_sum(kl_values))
        cols["ref_token_logps"].append(values[answer])
        cols["ref_kl_token_logps"].append(kl_values if len(kl_values) else [])
        cols["pair_example_id"].append(int(pair_ids[row]))
    return cols


def _score_trees(run: Pass, trees: list[Tree], pad_id: int, images=None) -> list[tuple[np.ndarray, ...]]:
    """score_shard with this pass's settings. Sharded, every process runs as many forwards as the busiest.
    `images(tree)`: the image processor's tensors of a tree's images (rows with images)."""
    return score_shard(
        run.reference.scorer,
        trees,
        pad_id,
        run.config.batch_size,
        run.reference.forward_tokens,
        run.state.device,
        run.progress.on_batch,
        packed=run.reference.plan.padded_because is None,
        agree_on_forwards=run.engine.agree_on_forwards if run.engine.collective_forwards else None,
        images=images,
        image_filler=None if run.prepared.image_rows is None else run.prepared.image_rows.filler(),
    )


def _tree_tokens(trees: list[Tree]) -> tuple[int, int]:
    """(needed, scored) tokens of a shard's trees. Needed, the minimal work: each prompt once, then its two
    continuations, no padding. Scored: as separate sequences, the prompt with each continuation."""
    prompts = sum(len(prompt) for prompt, _ in trees)
    answers = sum(len(answer) for _, continuations in trees for answer in continuations)
    return prompts + answers, 2 * prompts + answers
