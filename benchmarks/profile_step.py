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
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import HERE, SIZES, SMOLLM2_SIZES, build_assets, build_smollm2_assets  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="random", choices=("random", "smollm2"))
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--work", default=str(HERE / ".work"))
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    if args.case == "smollm2":
        size, work = SMOLLM2_SIZES[args.size], Path(args.work) / "smollm2"
        model_dir, data_path = build_smollm2_assets(work, size)
    else:
        size, work = SIZES[args.size], Path(args.work)
        build_assets(work, size)
        model_dir, data_path = work / "model", work / "data.jsonl"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kto_pipeline.data import load_source, normalize, tokenize
    from kto_pipeline.logprobs import backbone_of, chunked_token_logps, score_policy, score_sequences
    from kto_pipeline.packing import attention_costs
    from kto_pipeline.train import Collator, batch_layout

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = tokenize(tok, normalize(load_source(str(data_path))), size["max_length"])
    batch_rows = []
    first = np.arange(size["batch"])
    prompts, completions = rows.take(first, "prompt_ids"), rows.take(first, "completion_ids")
    partners = rows.take((first + 1) % len(rows), "completion_ids")
    for i in range(size["batch"]):
        prompt = prompts[i]
        room = size["max_length"] - len(prompt)
        partner = partners[i]
        batch_rows.append(
            {
                "prompt_ids": prompt,
                "completion_ids": completions[i][:room],
                "kl_completion_ids": partner[:room],
                "label": i % 2 == 0,
                "ref_logp": 0.0,
                "ref_kl_logp": 0.0,
                "example_id": i,
            }
        )
    packed = Collator(tok.pad_token_id, packed=True, attention=attention_costs(model, "cpu"))(batch_rows)
    layout = batch_layout(packed)
    padded = Collator(tok.pad_token_id, packed=False)(batch_rows)
    phases: dict[str, float] = {}

    def timed(name, fn):
        start = time.perf_counter()
        with record_function(name):
            out = fn()
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return out

    def packed_step():
        scored = timed("packed: completions (grad) + KL on cached prompts", lambda: score_policy(model, layout))
        timed("packed: backward", lambda: (-scored.completions.logps.sum()).backward())
        model.zero_grad(set_to_none=True)

    def padded_step():
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
            lambda: chunked_token_logps(hidden[:, :-1][mask], model.lm_head.weight, padded["input_ids"][:, 1:][mask])[
                0
            ],
        )
        timed("padded: backward", lambda: (-logps.sum()).backward())
        model.zero_grad(set_to_none=True)

    model.train()
    packed_step()  # warm-up
    padded_step()
    phases.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.batches):
            packed_step()
            padded_step()
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
                print(f"  {name:<60} {seconds / args.batches:7.3f} s/step  {seconds / total:6.1%}")
        print(f"  {kind + ' step':<60} {total / args.batches:7.3f} s/step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
