"""Parity with trl.KTOTrainer 1.16: on the same tiny model, data and max_length, kto-pipeline gives trl's numbers.

1. The reference pass: for standard unpaired, conversational, paired and implicit-prompt data, our cache holds
   the same (prompt_ids, completion_ids, label) rows as trl's precomputed train dataset (after trl's collator
   truncates prompt + completion to max_length), drops the same rows, and our `ref_logp` equals trl's
   `ref_logps`. Our KL partners differ from trl's by design (fixed at precompute time, docs/design.md), so for the KL
   side we score trl's own KL pairs with our `score_sequences` and compare with trl's `ref_KL_logps`.
2. Training: with `apo_zero_unpaired` (no KL term, so the KL partners do not matter), sequential order and the
   same optimizer settings, our per-step metrics (loss, grad norm, rewards, log-probs, ...) equal trl's.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import conversational_rows, unpaired_rows, write_jsonl

from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache
from kto_pipeline.scoring.logprobs import score_sequences
from kto_pipeline.stages.precompute.data import load_source, normalize, tokenize_row

ATOL = 1e-4
BATCH_SIZE = 4


# ------------------------------------------------------------------------------------------- data


def _standard_rows() -> list[dict]:
    # + one row whose prompt alone is longer than max_length (64): both trl and we drop it
    long_prompt = {"prompt": "User: " + "very long question " * 4 + "?\nAssistant:", "completion": " Ok", "label": True}
    return unpaired_rows(24) + [long_prompt]


def _conversational_rows() -> list[dict]:
    long_prompt = {
        "prompt": [{"role": "user", "content": "Tell me about " + "this long topic " * 4}],
        "completion": [{"role": "assistant", "content": "Sure."}],
        "label": True,
    }
    return conversational_rows(12) + [long_prompt]


def _paired_rows() -> list[dict]:
    rows = [
        {
            "prompt": f"Q{i}: what is {i} plus {i}?\nA:",
            "chosen": f" It is {2 * i}, because {i} + {i} = {2 * i}" + "!" * (i % 3),
            "rejected": " No idea" + "." * (i % 4),
        }
        for i in range(9)
    ]
    rows.append({"prompt": "Q: " + "what is this? " * 4 + "\nA:", "chosen": " This.", "rejected": " No."})
    return rows


def _implicit_rows() -> list[dict]:
    # chosen/rejected only: the shared prefix is the prompt; " It.." vs " No.." exercises the keep-the-space rule
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in _paired_rows()]


# name -> (rows, max_length): each max_length truncates some completions and drops the long-prompt row(s)
DATASETS = {
    "standard": (_standard_rows, 64),
    "conversational": (_conversational_rows, 60),
    "paired": (_paired_rows, 48),
    "implicit_prompt": (_implicit_rows, 48),
}


# ------------------------------------------------------------------------------------------- helpers


def _load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _trl_trainer(model_dir: Path, data_file: Path, work: Path, **config):
    """trl.KTOTrainer with precomputed reference log-probs, on a freshly loaded copy of the tiny model."""
    import datasets
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    # a cache_dir under tmp_path: trl caches its ref log-probs next to the dataset's own cache files
    dataset = datasets.load_dataset("json", data_files=str(data_file), split="train", cache_dir=str(work / "hf"))
    args = KTOConfig(
        output_dir=str(work / "trl"),
        precompute_ref_log_probs=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=BATCH_SIZE,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    return KTOTrainer(
        model=_load_model(model_dir),
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def _score(model, prompts: list[list[int]], completions: list[list[int]], max_length: int, pad_id: int):
    """Summed completion log-probs of (prompt + completion)[:max_length], one right-padded batch."""
    seqs = [(p + c)[:max_length] for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    comp = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        comp[i, len(p) : len(s)] = 1
    with torch.inference_mode():
        return score_sequences(model, ids, attn, comp).logps.numpy()


# ------------------------------------------------------------------------------ 1. reference pass


@pytest.mark.parametrize("kind", list(DATASETS))
def test_reference_logps_match_trl(kind, tiny_model_dir, tmp_path):
    make_rows, max_length = DATASETS[kind]
    data_file = write_jsonl(tmp_path / f"{kind}.jsonl", make_rows())

    trainer = _trl_trainer(tiny_model_dir, data_file, tmp_path, max_length=max_length)  # loss_type="kto"
    theirs = trainer.train_dataset
    assert {"prompt_ids", "completion_ids", "KL_completion_ids", "ref_logps", "ref_KL_logps"} <= set(
        theirs.column_names
    )
    trl_rows = theirs.select_columns(
        ["prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps"]
    ).to_list()

    cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(data_file),
            output=str(tmp_path / "cache"),
            max_length=max_length,
            dtype="float32",
            batch_size=5,  # several length-sorted batches ...
            shard_size=7,  # ... and several shards
        )
    )
    opened = open_cache(cache, verify=True)
    ours = opened.table.to_pylist()
    manifest = opened.manifest

    # --- the same rows survive, the same rows are dropped
    normalized = manifest["dataset"]["normalized_rows"]
    assert len(ours) == len(trl_rows) == manifest["counts"]["rows"]
    dropped = sum(manifest["counts"]["dropped"].values())
    assert dropped > 0, "the data should contain a row whose prompt reaches max_length"
    assert normalized - dropped == len(trl_rows)

    # --- the same (prompt_ids, completion_ids, label) multiset; trl truncates in its collator, we in the cache
    def key(prompt, completion, label):
        return (tuple(prompt), tuple(completion), bool(label))

    trl_by_key: dict[tuple, list[dict]] = defaultdict(list)
    truncated = 0
    for r in trl_rows:
        room = max_length - len(r["prompt_ids"])
        truncated += len(r["completion_ids"]) > room
        trl_by_key[key(r["prompt_ids"], r["completion_ids"][:room], r["label"])].append(r)
    assert truncated > 0, f"max_length {max_length} should truncate some completions"
    assert 0 < sum(r["label"] for r in trl_rows) < len(trl_rows)
    our_keys = Counter(key(r["prompt_ids"], r["completion_ids"], r["label"]) for r in ours)
    assert our_keys == Counter({k: len(v) for k, v in trl_by_key.items()})

    # --- ref_logp == trl's ref_logps (duplicate keys carry identical sequences, hence identical values)
    mine, expected = [], []
    for r in ours:
        mine.append(r["ref_logp"])
        expected.append(trl_by_key[key(r["prompt_ids"], r["completion_ids"], r["label"])][0]["ref_logps"])
    np.testing.assert_allclose(mine, expected, rtol=0, atol=ATOL)
    assert np.ptp(expected) > 1.0  # the values are not all alike, so a mismatched pairing would show
    for r in ours:  # the per-token values the cache stores add up to the sums
        assert len(r["ref_token_logps"]) == len(r["completion_ids"])
        assert abs(sum(r["ref_token_logps"]) - r["ref_logp"]) < ATOL

    # --- KL side: our scorer on trl's own KL pairs gives trl's ref_KL_logps
    model = _load_model(tiny_model_dir)
    pad_id = trainer.processing_class.pad_token_id
    prompts = [r["prompt_ids"] for r in trl_rows]
    kl_scores = _score(model, prompts, [r["KL_completion_ids"] for r in trl_rows], max_length, pad_id)
    np.testing.assert_allclose(kl_scores, [r["ref_KL_logps"] for r in trl_rows], rtol=0, atol=ATOL)
    kl_truncated = sum(len(r["prompt_ids"]) + len(r["KL_completion_ids"]) > max_length for r in trl_rows)
    assert kl_truncated > 0, "some of trl's KL sequences should be truncated too"

    # --- and our own KL pairs: partner's completion truncated for this prompt, scored as a direct pass would
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = normalize(load_source(str(data_file)))
    for r in ours:
        assert r["kl_example_id"] != r["example_id"]
        partner_completion = tokenize_row(tokenizer, rows[r["kl_example_id"]])[1]
        assert r["kl_completion_ids"] == partner_completion[: max_length - len(r["prompt_ids"])]
    our_kl = _score(model, [r["prompt_ids"] for r in ours], [r["kl_completion_ids"] for r in ours], max_length, pad_id)
    np.testing.assert_allclose([r["ref_kl_logp"] for r in ours], our_kl, rtol=0, atol=ATOL)


# ------------------------------------------------------------------------------------ 2. training


TRAIN_SETTINGS = {
    "learning_rate": 3e-3,  # large, so that the policy moves and later steps' losses are far from the first
    "logging_steps": 1,
    "lr_scheduler_type": "linear",
    "weight_decay": 0.1,  # decay on matrices, none on norms, in both
    "max_grad_norm": 0.5,
    "seed": 42,
    "beta": 0.1,
    "desirable_weight": 1.0,
    "undesirable_weight": 2.0,
}
COMPARED = [
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
]


@pytest.fixture(
    scope="module",
    # (gradient_accumulation_steps, max_steps): 24 rows / batch 4 = 6 forward passes per epoch, so the second
    # case averages the logged loss over 2 forward passes and runs into a second epoch
    # the third: both of our stages with compiled decoder layers (--torch-compile), attending on the dense mask
    params=[(1, 3, False), (2, 4, False), (1, 3, True)],
    ids=["accumulation1", "accumulation2", "compiled"],
)
def training_logs(request, tiny_model_dir, tmp_path_factory):
    """(ours, trl's) per-step logs of the same apo_zero_unpaired run: sequential order, same optimizer settings."""
    from torch.utils.data import SequentialSampler

    accumulation, max_steps, compiled = request.param
    ours_only = dict(torch_compile=True, attention_kernel="dense") if compiled else {}
    work = tmp_path_factory.mktemp("train-parity")
    max_length = 64  # truncates the long completions of unpaired_rows
    data_file = write_jsonl(work / "data.jsonl", unpaired_rows(24))
    settings = {**TRAIN_SETTINGS, "gradient_accumulation_steps": accumulation, "max_steps": max_steps}

    trainer = _trl_trainer(
        tiny_model_dir,
        data_file,
        work,
        max_length=max_length,
        loss_type="apo_zero_unpaired",
        warmup_steps=0,
        **settings,
    )
    # trl 1.16 + transformers 5.x: apo_zero_unpaired goes through Trainer's sampler, which honours the strategy
    assert trainer.args.train_sampling_strategy == "sequential"
    assert isinstance(trainer._get_train_sampler(), SequentialSampler)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]

    cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(data_file),
            output=str(work / "cache"),
            max_length=max_length,
            dtype="float32",
            **ours_only,
        )
    )
    train(
        TrainConfig(
            cache=str(cache),
            output_dir=str(work / "ours"),
            loss_type="apo_zero_unpaired",
            per_device_train_batch_size=BATCH_SIZE,
            warmup_ratio=0.0,
            bf16=False,
            train_sampling_strategy="sequential",
            **settings,
            **ours_only,
        )
    )
    ours = [json.loads(line) for line in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in theirs] == [r["step"] for r in ours] == list(range(1, max_steps + 1))
    return ours, theirs


def test_training_matches_trl(training_logs):
    ours, theirs = training_logs
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True), start=1):
        for name in COMPARED:
            assert mine[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-5), (step, name, mine, expected)
        assert mine["epoch"] == pytest.approx(expected["epoch"], abs=1e-4)  # we round it to 4 decimals
    # The check discriminates: the policy moved well beyond the tolerance, and clipping was exercised.
    assert abs(theirs[-1]["loss"] - theirs[0]["loss"]) > 0.1
    assert abs(theirs[-1]["rewards/margins"]) > 0.1
    assert max(h["grad_norm"] for h in theirs) > TRAIN_SETTINGS["max_grad_norm"]


def test_logged_learning_rate_matches_trl(training_logs):
    ours, theirs = training_logs
    assert [r["learning_rate"] for r in ours] == pytest.approx([h["learning_rate"] for h in theirs], rel=1e-6)
