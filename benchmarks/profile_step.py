"""Where the time of kto-pipeline's reference pass and training step goes (torch.profiler).

    python benchmarks/profile_step.py [--size full] [--batches 3]

Uses the benchmark's model and data (benchmarks/bench.py builds them), scores length-sorted
reference batches and runs training steps as `train` does (KL forward without grad, policy
forward + backward), and prints the phases' wall times and the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import HERE, SIZES, build_assets  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--work", default=str(HERE / ".work"))
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    size, work = SIZES[args.size], Path(args.work)
    build_assets(work, size)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kto_pipeline.data import load_source, normalize, tokenize
    from kto_pipeline.logprobs import backbone_of, chunked_token_logps, score_sequences
    from kto_pipeline.train import Collator

    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    rows = tokenize(tok, normalize(load_source(str(work / "data.jsonl"))), size["max_length"])
    batch_rows = []
    for i in range(size["batch"]):
        prompt = rows.prompt_ids[i]
        room = size["max_length"] - len(prompt)
        partner = rows.completion_ids[(i + 1) % len(rows.example_ids)]
        batch_rows.append(
            {
                "prompt_ids": prompt,
                "completion_ids": rows.completion_ids[i][:room],
                "kl_completion_ids": partner[:room],
                "label": i % 2 == 0,
                "ref_logp": 0.0,
                "ref_kl_logp": 0.0,
                "example_id": i,
            }
        )
    batch = Collator(tok.pad_token_id)(batch_rows)
    phases: dict[str, float] = {}

    def timed(name, fn):
        start = time.perf_counter()
        with record_function(name):
            out = fn()
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return out

    def step():
        with torch.no_grad():
            timed(
                "KL forward (no grad)",
                lambda: score_sequences(
                    model, batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_completion_mask"]
                ),
            )
        hidden = timed(
            "policy backbone forward",
            lambda: (
                backbone_of(model)(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
                ).last_hidden_state
            ),
        )
        mask = batch["completion_mask"][:, 1:].bool()
        logps = timed(
            "policy LM head, chunked (completion tokens only)",
            lambda: chunked_token_logps(hidden[:, :-1][mask], model.lm_head.weight, batch["input_ids"][:, 1:][mask])[0],
        )
        timed("backward", lambda: (-logps.sum()).backward())
        model.zero_grad(set_to_none=True)

    model.train()
    step()  # warm-up
    phases.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.batches):
            step()
    total = sum(phases.values())
    tokens = int(batch["attention_mask"].sum() + batch["kl_attention_mask"].sum())
    scored = int(batch["completion_mask"][:, 1:].sum() + batch["kl_completion_mask"][:, 1:].sum())
    print(f"training step, batch {size['batch']}: {tokens} tokens of which {scored} completion tokens are scored")
    for name, seconds in phases.items():
        print(f"  {name:<50} {seconds / args.batches:7.3f} s/step  {seconds / total:6.1%}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
