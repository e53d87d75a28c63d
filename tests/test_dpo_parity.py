"""Parity with trl.DPOTrainer 1.16 (`precompute_ref_log_probs=True`): on the same tiny model, paired data, max_length
and settings, a pair loss trained on kto-pipeline's cache gives trl's numbers.

1. The reference pass: the pairs our cache holds (`CachePairs`: a paired cache's rows joined by `pair_example_id`)
   are trl's (prompt_ids, chosen_ids, rejected_ids) after trl's collator truncates them to max_length, in trl's
   order, the same pairs dropped, and our cached reference log-probs are trl's `ref_chosen_logps` /
   `ref_rejected_logps` (rel 1e-4). Explicit and implicit prompts.
2. Training, for every loss type (and f-divergences, MPO weights, LD-DPO, gradient accumulation): over 3 steps in
   sequential order, our logged loss, grad norm and trl's metrics equal trl's (rel 2e-3).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_jsonl

from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache
from kto_pipeline.objectives.pairs import PAIR_LOSS_TYPES, CachePairs

BATCH_SIZE = 4
MAX_LENGTH = 48  # truncates some chosen answers, drops the long-prompt pair


def paired_rows(n: int = 16) -> list[dict]:
    rows = [
        {
            "prompt": f"Q{i}: what is {i} plus {i}?\nA:",
            "chosen": f" It is {2 * i}, because {i} + {i} = {2 * i}" + "!" * (i % 3),
            "rejected": " No idea" + "." * (i % 4) + " at all" * (i % 2),
        }
        for i in range(n)
    ]
    rows.insert(5, {"prompt": "Q: " + "what is this? " * 4 + "\nA:", "chosen": " This.", "rejected": " No."})
    return rows


def implicit_rows() -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in paired_rows(8)]


def _trl_trainer(model_dir: Path, data_file: Path, work: Path, **config):
    """trl.DPOTrainer with precomputed reference log-probs, on a freshly loaded copy of the tiny model."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    dataset = datasets.load_dataset("json", data_files=str(data_file), split="train", cache_dir=str(work / "hf"))
    args = DPOConfig(
        output_dir=str(work / "trl"),
        precompute_ref_log_probs=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=BATCH_SIZE,
        train_sampling_strategy="sequential",
        max_length=MAX_LENGTH,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    return DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def _cache(model_dir: Path, data_file: Path, out: Path, **kw) -> Path:
    config = PrecomputeConfig(
        model=str(model_dir), dataset=str(data_file), output=str(out), max_length=MAX_LENGTH, dtype="float32", **kw
    )
    return precompute(config)


# ------------------------------------------------------------------------------ 1. reference pass


@pytest.mark.parametrize("kind", ["explicit", "implicit"])
@pytest.mark.parametrize("pairs_only", [False, True], ids=["with-kl", "pairs-only"])
def test_cached_pairs_are_trls_with_its_reference_logps(kind, pairs_only, tiny_model_dir, tmp_path):
    rows = paired_rows() if kind == "explicit" else implicit_rows()
    data_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    theirs = _trl_trainer(tiny_model_dir, data_file, tmp_path).train_dataset.to_list()
    cache = _cache(tiny_model_dir, data_file, tmp_path / "cache", shard_size=6, batch_size=5, pairs_only=pairs_only)
    ours = CachePairs(open_cache(cache, verify=True), MAX_LENGTH)

    assert len(ours) == len(theirs) == len(rows) - 1  # the long-prompt pair is dropped by both
    truncated = 0
    for i, t in enumerate(theirs):
        mine = ours[i]
        room = MAX_LENGTH - len(t["prompt_ids"])
        truncated += len(t["chosen_ids"]) > room
        assert mine["prompt_ids"] == t["prompt_ids"]
        assert mine["chosen_ids"] == t["chosen_ids"][:room]
        assert mine["rejected_ids"] == t["rejected_ids"][:room]
        for side in ("chosen", "rejected"):
            assert mine[f"ref_{side}_logp"] == pytest.approx(t[f"ref_{side}_logps"], rel=1e-4, abs=1e-5), (i, side)
    assert kind == "implicit" or truncated > 0, "max_length should truncate some chosen answers"
    assert np.ptp([t["ref_chosen_logps"] for t in theirs]) > 0.5  # distinct values: a mismatched pairing would show


# ------------------------------------------------------------------------------------ 2. training

TRAIN_SETTINGS = {
    "learning_rate": 3e-3,  # large, so that the policy moves and later steps' numbers are far from the first
    "logging_steps": 1,
    "lr_scheduler_type": "linear",
    "weight_decay": 0.1,
    "max_grad_norm": 0.5,
    "seed": 42,
}
COMPARED = [
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
]
CASES = {
    **{t: {"loss_type": t} for t in PAIR_LOSS_TYPES if t not in ("exo_pair", "robust")},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    "robust": {"loss_type": "robust", "label_smoothing": 0.2},
    "aot-smoothed": {"loss_type": "aot", "label_smoothing": 0.1},
    "mpo": {"loss_type": "sigmoid+bco_pair+sft", "loss_weights": "0.8,0.2,1.0"},
    "js_divergence": {"loss_type": "sigmoid", "f_divergence_type": "js_divergence"},
    "alpha_divergence": {"loss_type": "hinge", "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    "ld_alpha": {"loss_type": "sigmoid", "ld_alpha": 0.5},
    "beta-accumulation": {"loss_type": "sigmoid", "beta": 0.5, "gradient_accumulation_steps": 2},
    # both of our stages with compiled decoder layers (--torch-compile) on the dense mask; trl's run is the same
    "sigmoid-compiled": {"loss_type": "sigmoid", "torch_compile": True, "attention_kernel": "dense"},
}
OURS_ONLY = ("torch_compile", "attention_kernel")


def _trl_options(case: dict) -> dict:
    options = {k: v for k, v in case.items() if k not in OURS_ONLY}
    options["loss_type"] = options["loss_type"].split("+")
    if "loss_weights" in options:
        options["loss_weights"] = [float(w) for w in options["loss_weights"].split(",")]
    return options


@pytest.fixture(scope="module")
def parity_data(tiny_model_dir, tmp_path_factory):
    """(work dir, data file, our paired cache): one reference pass for every case."""
    work = tmp_path_factory.mktemp("dpo-parity")
    data_file = write_jsonl(work / "pairs.jsonl", paired_rows(24))
    return work, data_file, _cache(tiny_model_dir, data_file, work / "cache")


@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_trl(name, parity_data, tiny_model_dir):
    work, data_file, cache = parity_data
    case, steps = CASES[name], 3
    ours_only = {k: v for k, v in case.items() if k in OURS_ONLY}
    if ours_only:  # the reference pass computed as training computes
        cache = _cache(tiny_model_dir, data_file, work / name / "cache", **ours_only)
    trainer = _trl_trainer(
        tiny_model_dir, data_file, work / name, max_steps=steps, warmup_steps=0, **TRAIN_SETTINGS, **_trl_options(case)
    )
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]

    out = work / name / "ours"
    train(
        TrainConfig(
            cache=str(cache),
            output_dir=str(out),
            per_device_train_batch_size=BATCH_SIZE,
            max_steps=steps,
            warmup_ratio=0.0,
            bf16=False,
            train_sampling_strategy="sequential",
            **TRAIN_SETTINGS,
            **case,
        )
    )
    ours = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in theirs] == [r["step"] for r in ours] == list(range(1, steps + 1))
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True), start=1):
        for metric in COMPARED:
            if ours_only and step == 1 and metric == "rewards/accuracies":
                # compiled, the reference pass's graph (no gradients) and training's round a few token log-probs 1
                # ulp apart (4.8e-7), so step 1's rewards are within 1e-6 of trl's 0 and their signs, which decide
                # the accuracy, are noise
                assert max(abs(mine[f"rewards/{k}"]) for k in ("chosen", "rejected")) < 1e-6, mine
                continue
            assert mine[metric] == pytest.approx(expected[metric], rel=2e-3, abs=1e-5), (step, metric, mine, expected)
        assert mine["learning_rate"] == pytest.approx(expected["learning_rate"], rel=1e-6)
    # the check discriminates: the policy moved beyond the tolerance
    assert abs(theirs[-1]["rewards/margins"] - theirs[0]["rewards/margins"]) > 1e-2
