"""Where the time of kto-pipeline's reference pass and training step goes (torch.profiler).

    python benchmarks/profile_step.py [--case random|smollm2] [--size full] [--batches 3]

Uses a benchmark case's model and data (benchmarks/bench.py builds them: the random Qwen2-style model, or
SmolLM2-135M-Instruct on HH-RLHF rows) and runs training steps as
`train` does: packed (prompts and completions with grad in a few rows, then the KL completions on
the prompts' cached keys/values, then the backward) and, for comparison, padded (the fallback: KL
forward without grad, policy forward, chunked LM head, backward). Prints each phase's wall time
and the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from bench import build_assets, build_smollm2_assets
from harness import SIZES, SMOLLM2_SIZES, WORK_DIR
from torch.profiler import ProfilerActivity, profile, record_function


def load_case(case: str, size_name: str, work: Path) -> tuple[dict, Path, Path]:
    """(the case's size, its model directory, its dataset), built by bench.py's builders where missing."""
    if case == "smollm2":
        size, work = SMOLLM2_SIZES[size_name], work / "smollm2"
        model_dir, data_path = build_smollm2_assets(work, size)
    else:
        size = SIZES[size_name]
        build_assets(work, size)
        model_dir, data_path = work / "model", work / "data.jsonl"
    return size, model_dir, data_path


def first_batch(tok, data_path: Path, size: dict) -> list[dict]:
    """The first `batch` rows as train's collator takes them, each with the next row's completion as its KL one."""
    from kto_pipeline.stages.precompute.data import load_source, normalize, tokenize

    rows = tokenize(tok, normalize(load_source(str(data_path))), size["max_length"])
    batch_rows = []
    first = np.arange(size["batch"])
    prompts, completions = rows.take(first, "prompt_ids"), rows.take(first, "completion_ids")
    partners = rows.take((first + 1) % len(rows), "completion_ids")
    for i, (prompt, completion, partner) in enumerate(zip(prompts, completions, partners, strict=True)):
        room = size["max_length"] - len(prompt)
        row = dict(prompt_ids=prompt, completion_ids=completion[:room], kl_completion_ids=partner[:room])
        batch_rows.append(dict(row, label=i % 2 == 0, ref_logp=0.0, ref_kl_logp=0.0, example_id=i))
    return batch_rows


class Phases:
    """Wall seconds per named phase, summed over calls; each call is a torch.profiler range of that name too."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name, fn):
        start = time.perf_counter()
        with record_function(name):
            out = fn()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out


def packed_step(model, layout, timed: Phases) -> None:
    from kto_pipeline.scoring.logprobs import score_policy

    scored = timed("packed: completions (grad) + KL on cached prompts", lambda: score_policy(model, layout))
    timed("packed: backward", lambda: (-scored.completions.logps.sum()).backward())
    model.zero_grad(set_to_none=True)


def padded_step(model, padded: dict, timed: Phases) -> None:
    from kto_pipeline.models import backbone_of
    from kto_pipeline.scoring.logprobs import chunked_token_logps, score_sequences

    with torch.no_grad():
        timed(
            "padded: KL forward (no grad)",
            lambda: score_sequences(
                model, padded["kl_input_ids"], padded["kl_attention_mask"], padded["kl_completion_mask"]
            ),
        )
    hidden = timed(
        "padded: policy backbone forward",
        lambda: (
            backbone_of(model)(
                input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False
            ).last_hidden_state
        ),
    )
    mask = padded["completion_mask"][:, 1:].bool()
    logps = timed(
        "padded: policy LM head, chunked (completion tokens only)",
        lambda: chunked_token_logps(hidden[:, :-1][mask], model.lm_head.weight, padded["input_ids"][:, 1:][mask])[0],
    )
    timed("padded: backward", lambda: (-logps.sum()).backward())
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="random", choices=("random", "smollm2"))
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--work", default=str(WORK_DIR))
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    size, model_dir, data_path = load_case(args.case, args.size, Path(args.work))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kto_pipeline.objectives.items import batch_layout
    from kto_pipeline.objectives.kto import Collator
    from kto_pipeline.scoring.attention import attention_costs

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch_rows = first_batch(tok, data_path, size)
    packed = Collator(tok.pad_token_id, packed=True, attention=attention_costs(model, "cpu"))(batch_rows)
    layout = batch_layout(packed)
    padded = Collator(tok.pad_token_id, packed=False)(batch_rows)
    timed = Phases()

    model.train()
    packed_step(model, layout, timed)  # warm-up
    padded_step(model, padded, timed)
    timed.seconds.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.batches):
            packed_step(model, layout, timed)
            padded_step(model, padded, timed)
    report(timed.seconds, packed, layout, padded, size, args.batches)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


def report(phases: dict[str, float], packed: dict, layout, padded: dict, size: dict, batches: int) -> None:
    """The tokens each way runs, then each phase's seconds per step and share of its step."""
    needed = int(packed["tokens_needed"])
    rows, width = layout.input_ids.shape
    executed_packed = rows * layout.split + int((layout.branch == 2).sum())
    executed_padded = padded["input_ids"].numel() + padded["kl_input_ids"].numel()
    print(
        f"training step, batch {size['batch']}: {needed} tokens needed (each prompt once); forwards run "
        f"{executed_packed} packed ({rows} rows), {executed_padded} padded"
    )
    for kind in ("packed", "padded"):
        total = sum(v for k, v in phases.items() if k.startswith(kind))
        for name, seconds in phases.items():
            if name.startswith(kind):
                print(f"  {name:<60} {seconds / batches:7.3f} s/step  {seconds / total:6.1%}")
        print(f"  {kind + ' step':<60} {total / batches:7.3f} s/step")


if __name__ == "__main__":
    main()
