"""What the loss families' items share: a cache row as training reads it (`with_sums`), a micro-batch
laid out packed (`packed_batch`: trees side by side in rows, `scoring/packing.py`, no padding) or padded
(`padded_batch`), the layout a packed batch carries (`batch_layout`, which the train stage's scorer reads), and
which items of an uneven last batch are real (`real_rows`)."""

from __future__ import annotations

from typing import Any

import torch

from kto_pipeline.cache import completion_room, token_sum
from kto_pipeline.scoring.logprobs import join_images, pad_sequences
from kto_pipeline.scoring.packing import AttentionCosts, Layout, layout_trees, pack_rows

# a cache row's sequences after its prompt: (token ids, per-token reference log-probs, their sum)
COMPLETION = ("completion_ids", "ref_token_logps", "ref_logp")
KL_COMPLETION = ("kl_completion_ids", "ref_kl_token_logps", "ref_kl_logp")


def with_sums(row: dict[str, Any], max_length: int, with_kl: bool) -> dict[str, Any]:
    """A cache row as training reads it: each sequence after the prompt cut at a train-time `max_length` (it keeps
    the room the prompt leaves), its reference log-prob the sum of the kept tokens' cached values (`token_sum`: what
    precomputing at that length gives, and how training sums the policy's, whichever version wrote the cache)."""
    room = completion_room(row["prompt_ids"], max_length)
    for ids, logps, total in (COMPLETION, KL_COMPLETION) if with_kl else (COMPLETION,):
        if len(row[ids]) > room:
            row[ids] = row[ids][:room]
            row[logps] = row[logps][:room]
        row[total] = token_sum(row[logps])
    return row


def cache_rows(table, indices, max_length: int, with_kl: bool) -> list[dict[str, Any]]:
    """Rows `indices` of a cache's table as training reads them (`with_sums`), converted in one go: slices joined,
    not `take` (pyarrow's take joins a chunked column's chunks first, a copy of the whole cache's column)."""
    import pyarrow as pa

    rows = pa.concat_tables([table.slice(int(i), 1) for i in indices]).to_pylist()
    return [with_sums(row, max_length, with_kl) for row in rows]


LAYOUT_KEY = "layout_"  # batch keys of a packed layout's tensors
IMAGE_KEY = "image_"  # batch keys of the image processor's tensors (rows with images), in the forward's order


def cache_images(cache):
    """A cache of rows with images: its dataset's images (`images.ImageRows`), every one checked against the cache's
    pixel hashes before any step, so that a changed or missing image stops the run naming its row and file. None
    for a cache of text rows."""
    if cache.manifest.images is None:
        return None
    from kto_pipeline.images import ImageRows

    images = ImageRows.of_cache(cache.manifest)
    images.check_all(cache.table)
    return images


def image_batch(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batch keys of the images of a forward's prompts (or padded sequences), in its order: each row's
    `pixels` joined (`join_images`); none for rows without images."""
    joined = join_images(parts)
    return {} if joined is None else {IMAGE_KEY + k: v for k, v in joined.items()}


def batch_images(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The image tensors a batch carries, as the scorer takes them (None: no images)."""
    found = {k.removeprefix(IMAGE_KEY): v for k, v in batch.items() if k.startswith(IMAGE_KEY)}
    return found or None


def packed_batch(
    trees, sizes: list[int], pad_id: int, attention: AttentionCosts | None, split_last: bool = False, items=()
):
    """The batch tensors of `(prompt, [continuation, ...])` trees packed side by side in rows (`pack_rows` by
    `sizes`, `attention`: the model's costs); with `split_last`, each row's last continuations after the others
    (`layout_trees`), to run apart without gradients on the prompts' cached keys/values. `items` (one a tree): their
    `pixels`, where they have images, join the batch in the order the layout holds the prompts."""
    static, align = (attention.static, attention.align) if attention is not None else (False, 1)
    rows = pack_rows(sizes, None, attention)
    layout = layout_trees(trees, rows, pad_id, split_last=split_last, static=static, align=align)
    batch = {LAYOUT_KEY + k: v for k, v in vars(layout).items() if isinstance(v, torch.Tensor)}
    if items and "pixels" in items[0]:
        batch.update(image_batch([items[t]["pixels"] for t in layout.prompt_order()]))
    # the layout's sizes stay Python ints: moving the batch to an accelerator leaves them on the host, so that
    # reading them never waits for the device (a tensor read back with int() would, each step)
    batch[LAYOUT_KEY + "num_trees"] = layout.num_trees
    batch[LAYOUT_KEY + "branches"] = layout.branches
    batch[LAYOUT_KEY + "align"] = layout.align
    if split_last:
        batch[LAYOUT_KEY + "split"] = layout.split
    return batch


def padded_batch(items: list[dict[str, Any]], keys: tuple[str, ...], pad_id: int, prefix: str = ""):
    """`PREFIXinput_ids`, `PREFIXattention_mask` and `PREFIXcompletion_mask` of prompt + continuation sequences,
    item by item, each item's `keys` in order (a row's completion; a pair's chosen then rejected answer). Items with
    images: the unprefixed sequences' `pixels` too, one per sequence (a KTO batch's `kl_` sequences are the same
    rows in the same order, and take the same images)."""
    seqs = [item["prompt_ids"] + item[key] for item in items for key in keys]
    prompt_lens = [len(item["prompt_ids"]) for item in items for _ in keys]
    padded = pad_sequences(seqs, prompt_lens, pad_id)
    names = (f"{prefix}input_ids", f"{prefix}attention_mask", f"{prefix}completion_mask")
    batch = dict(zip(names, padded, strict=True))
    if not prefix and items and "pixels" in items[0]:
        batch.update(image_batch([item["pixels"] for item in items for _ in keys]))
    return batch


def batch_layout(batch: dict[str, torch.Tensor]) -> Layout | None:
    """The packed layout a packed batch carries (None for a padded batch)."""
    if LAYOUT_KEY + "input_ids" not in batch:
        return None
    fields = {k.removeprefix(LAYOUT_KEY): v for k, v in batch.items() if k.startswith(LAYOUT_KEY)}
    fields.setdefault("split", fields["input_ids"].shape[1])
    return Layout(**fields)


def real_rows(accelerator, batch_size: int, dataset_rows: int, last_batch: bool) -> torch.Tensor | None:
    """(B,) 1.0 for this process's real rows (pairs, for a pair loss), 0.0 for the rows accelerate repeats so that
    every process gets a full last batch (`even_batches`); None when the global batch has no repeated row.
    `batch_size`: the loader's per-process batch size. The same on every process, so that all take the same
    collectives. (Computed here: accelerate's own remainder is lost in a loader resumed with skip_first_batches.)"""
    remainder = dataset_rows % (batch_size * accelerator.num_processes)
    if accelerator.num_processes == 1 or not last_batch or remainder == 0:
        return None
    first = accelerator.process_index * batch_size  # the gathered global batch: process 0's rows, then 1's, ...
    positions = torch.arange(first, first + batch_size, device=accelerator.device)
    return (positions < remainder).float()
