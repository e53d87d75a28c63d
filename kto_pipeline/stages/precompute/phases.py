"""What passes between the phases of one precompute (`stage.py`'s outline): one dataclass each.

`Pass` is the run state. `setup` makes it and each later phase fills in one field with its result, a dataclass
(`prepared`, `reference`, `output`, `progress`), so that a phase reads what an earlier one decided by name, never
by a string key. The manifest and its entries stay dicts: they are the JSON on disk (docs/cache-format.md).
These types live apart from the outline so that `append.py` and `shards.py`, which the outline calls, take a
`Pass` without importing the stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tqdm.auto import tqdm

from kto_pipeline.cache.manifest import Manifest
from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.runtime.engines import Engine
from kto_pipeline.runtime.launch import main_decides, shows_progress
from kto_pipeline.runtime.peak_memory import PeakMemory
from kto_pipeline.scoring.plan import Plan
from kto_pipeline.stages.precompute.data import TokenizedRows


@dataclass
class SegmentRows:
    """What the cache records of the rows this run writes: `segments.new_segment`'s keywords but for how their KL
    partners were drawn and their keys file (manifest JSON)."""

    source: dict[str, Any]  # the dataset: name_or_path, config, split, content_hash, source_rows
    first_example_id: int  # example ids first_example_id .. + normalized_rows - 1 are these rows, kept or dropped
    normalized_rows: int
    rows: int  # kept
    desirable: int
    dropped: dict[str, int]  # {reason: rows}
    conversational: bool  # the prompt kind of the first row
    matched_rows: int  # rows of the dataset that the cache held already (an append), not scored again
    pairs: dict[str, int] | None  # complete, rows_without_partner (None: a version-1 cache, which records none)


@dataclass
class PreparedRows:
    """The kept rows of the dataset (of an append: its new rows), tokenized and memory-mapped, with their KL
    partners and their place in the cache (`prepare_rows`)."""

    rows: TokenizedRows  # numpy indices into the memory-mapped tokenized table
    example_ids: np.ndarray  # (n,) each kept row's example id in the cache
    partners: np.ndarray  # (n,) each kept row's KL partner, as a position among the kept rows
    pair_ids: np.ndarray  # (n,) the example id of each kept row's pair partner (NO_PAIR: none in these rows)
    segment: SegmentRows  # what the cache records of these rows
    key_files: list[str]  # the content keys of every normalized row of the dataset (segments.content_keys)
    key_rows: np.ndarray | None  # which of them these rows are (None: all)
    source_rows: int
    data_hash: str
    images: dict[str, Any] | None  # rows with images: {column, root, processor_hash} (manifest JSON); else None
    image_rows: Any  # rows with images: `images.ImageRows`, the dataset's images as the reference takes them
    tokenizer_hash: str
    cached: bool  # the tokenized rows were read from the datasets cache
    tokenize_seconds: float  # the datasets.map part of `seconds`
    seconds: float  # load, check, key, tokenize and select
    outside_partner: tuple[int, list[int]] | None = None  # a one-row append's KL partner: (example id, completion)


@dataclass
class Reference:
    """The reference model, loaded and ready to score (`load_reference`)."""

    model: Any
    weights_hash: str | None  # of the weights as loaded (main process; None on the others)
    scorer: Any  # the scoring forward: a ReferenceScorer (the FSDP2 root when sharded), or ZeRO-3's engine
    plan: Plan  # how it runs: precision, packed or padded (the packing check may pad it), kernel, compiled layers
    forward_tokens: int  # the token budget of a forward: --max-tokens-per-batch, or `attention.forward_tokens`
    quantization: Any = None  # with --load-in-4bit/8bit: `quantization.Quantization`


@dataclass
class Output:
    """The cache this run writes into (`plan_output`): its manifest and the segment this run adds to it."""

    manifest: Manifest  # written after each round: a new cache's, or the cache's with the append under `appending`
    segment: dict[str, Any] | None  # the manifest entry of the segment this run writes (None off the main process
    # of a full precompute, where only the main process writes the manifest)
    written: list[dict[str, Any]]  # its finished shards (manifest entries): the manifest's own list, which grows
    first_shard: int  # its first shard's file number


@dataclass
class ShardStats:
    """One process's shard of one round, gathered by the main process: rows, and tokens scored (each prompt with
    each continuation), executed (padding included) and needed (each prompt once, no padding); forwards run."""

    rows: int = 0
    scored: int = 0
    executed: int = 0
    needed: int = 0
    forwards: int = 0


class ShardProgress:
    """The reference pass's progress bar and counters (`score_shards`; `finish` records them). Between rounds the
    bar moves per forward pass: this process's batches, times the process count (an estimate; each round's end
    sets the exact count)."""

    def __init__(self, total_rows: int, done_rows: int, state):
        self.started = time.perf_counter()
        self.bar = tqdm(
            total=total_rows, initial=done_rows, unit="row", desc="reference pass", disable=not shows_progress(state)
        )
        self.total_rows, self.done_rows, self.processes = total_rows, done_rows, state.num_processes
        self.estimate_rows = self.estimate_tokens = 0.0
        self.executed_here = self.forwards_here = 0  # tokens (padding included) and forwards this process ran in
        # this round; of this run, all processes: rows and tokens scored (prompts counted per sequence), executed and
        # needed, and the forwards
        self.rows_scored = self.tokens_scored = self.tokens_executed = self.tokens_needed = self.forwards = 0

    def on_batch(self, sequences: int, tokens: int, executed: int) -> None:
        """After each forward pass: sequences (two a row), the tokens they need, the tokens the pass ran."""
        self.executed_here += executed
        self.forwards_here += 1
        self.estimate_rows += sequences / 2 * self.processes
        self.estimate_tokens += tokens * self.processes
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.n = int(min(self.done_rows + self.estimate_rows, self.total_rows))
        rows, tokens = self.rows_scored + self.estimate_rows, self.estimate_tokens
        self.bar.set_postfix_str(f"{rows / elapsed:.1f} rows/s, {tokens / elapsed:.0f} tokens/s")

    def end_round(self, stats: list[ShardStats]) -> None:
        """After each round, with every process's shard stats."""
        self.rows_scored += sum(s.rows for s in stats)
        self.tokens_scored += sum(s.scored for s in stats)
        self.tokens_executed += sum(s.executed for s in stats)
        self.tokens_needed += sum(s.needed for s in stats)
        self.forwards += sum(s.forwards for s in stats)
        self.done_rows += sum(s.rows for s in stats)
        self.estimate_rows, self.estimate_tokens = 0.0, float(self.tokens_scored)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.n = self.done_rows
        rows, tokens = self.rows_scored, self.tokens_scored
        self.bar.set_postfix_str(f"{rows / elapsed:.1f} rows/s, {tokens / elapsed:.0f} tokens/s")


@dataclass
class Pass:
    """One precompute's run state: what `setup` makes, then each phase's result, filled in as the outline goes."""

    config: PrecomputeConfig
    out: Path
    state: Any  # accelerate's PartialState: one process, or one per device under accelerate launch / torchrun
    engine: Engine  # how the reference is spread over the processes (runtime/engines)
    started: float
    tokenizer: Any
    peaks: PeakMemory  # each process's peak memory, sampled from the start
    quantization: Any = None  # `setup`: --load-in-4bit/8bit's `quantization.Quantization`, None: not quantized
    base: Manifest | None = None  # `open_base` (--append): the cache's manifest as this run found it
    prepared: PreparedRows | None = None  # `prepare_rows`
    reference: Reference | None = None  # `load_reference`
    output: Output | None = None  # `plan_output`
    progress: ShardProgress | None = None  # `score_shards`


T = TypeVar("T")


def on_main(state, decide: Callable[[], T]) -> T:
    """`main_decides` for an answer of any picklable type: `decide()` runs on the main process only and its answer
    is handed to every process (a failure fails every process)."""
    return main_decides(state, lambda: {"answer": decide()})["answer"]


def absolute_if_local(name: str) -> str:
    """A model or dataset as the manifest records it: a local path absolute (so that `train` finds it from any
    working directory), a hub name as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name
