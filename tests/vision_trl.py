"""trl 1.16 as an oracle on a tiny LLaVA: vision rows, trl's tokenization, trl's training logs, reference log-probs.

A helper module for the vision parity tests (no tests here). Everything runs on the CPU in float32, seeded, with
the reference model online (trl refuses `precompute_ref_log_probs=True` for vision datasets):

    vision_rows(n, seed, paired)           trl's conversational vision rows, PIL images from `toy_images`
    write_vision_jsonl(rows, directory)    the same rows as PNG files + a data.jsonl of relative image paths
    read_vision_jsonl(path)                back to rows with PIL images
    trl_kto_logs(model_dir, rows, ...)     trl.KTOTrainer's per-step log_history (sequential order)
    trl_dpo_logs(model_dir, rows, ...)     trl.DPOTrainer's per-step log_history (sequential order)
    trl_vision_tokens(model_dir, rows, L)  what trl's vision collators make of each row (a batch of 1)
    reference_logps(model_dir, rows, L)    summed completion log-probs from the full logits, independent of trl

How trl's vision collators (`DataCollatorForVisionUnpairedPreference`, `DataCollatorForVisionPreference`) tokenize:
the chat template renders prompt and prompt + completion as strings; the completion is the rendering's tail after the
prompt, so a conversational completion ends with the template's `<|im_end|>\n` (2 tokens with the character
tokenizer) and nothing else is appended (a non-conversational vision completion gets no eos: the text path's
`add_eos` is skipped for vision datasets). The processor expands `<image>` into 16 image tokens in the prompt;
prompt (left-padded) + completion (right-padded) are flushed left and cut to `max_length` keeping the start
(`input_ids[:, :max_length]`), so a long prompt can lose its completion entirely (trl drops no row) or, shorter
still, its image tokens (the model then raises).

Run `python tests/vision_trl.py` for a self-check on a freshly built tiny LLaVA.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import torch

from kto_pipeline.demo.tiny_vision import toy_images

DEFAULT_MAX_LENGTH = 80  # prompts are 43-56 tokens (16 of them image tokens): the longer completions get truncated

_QUESTIONS = [
    "What is this?",
    "Describe it.",
    "Any animals here?",
    "What colour is it?",
    "Is it noisy?",
    "Name the shape.",
    "Count the dots.",
    "Is this a cat?",
]
_GOOD = [
    "A cat.",
    "Mostly red noise.",
    "It looks like random coloured pixels.",
    "Yes, a small dog",
    "Blue and green squares, nothing else.",
    "Static.",
    "Three dots, I think",
    "A noisy picture of many tiny squares in colour.",
]
_BAD = ["No.", "I refuse", "Dunno, ask someone else.", "Banana!", "It is definitely a truck on a road.", "?"]


# ------------------------------------------------------------------------------------------------ data


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def vision_rows(n: int, seed: int = 0, paired: bool = False) -> list[dict]:
    """`n` rows in trl's conversational vision format, one PIL image each (every fourth row reuses an image).

    unpaired: {"images", "prompt", "completion", "label"} with labels 2:1 desirable; paired: {"images", "prompt",
    "chosen", "rejected"}. Completions are 1-47 characters, so their token counts (+2 for `<|im_end|>\\n`) vary.
    """
    import random

    rng = random.Random(seed)
    images = toy_images(n, seed=seed)
    rows = []
    for i in range(n):
        image = images[i - 1] if i % 4 == 3 else images[i]  # rows 2 and 3, 6 and 7, ... share an image
        question = f"{rng.choice(_QUESTIONS)} #{i}"
        good, bad = rng.choice(_GOOD), rng.choice(_BAD)
        row: dict = {"images": [image], "prompt": _user(question)}
        if paired:
            row |= {"chosen": _assistant(good), "rejected": _assistant(bad)}
        else:
            label = i % 3 != 0
            row |= {"completion": _assistant(good if label else bad), "label": label}
        rows.append(row)
    return rows


def write_vision_jsonl(rows: list[dict], directory: str | Path) -> Path:
    """Write `rows` to `directory/data.jsonl`, their images as PNG files in `directory/images/`.

    The jsonl's `images` column holds paths relative to the jsonl file; an image object shared by several rows is
    written once. Returns the jsonl path.
    """
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    written: dict[int, str] = {}
    lines = []
    for row in rows:
        paths = []
        for image in row["images"]:
            if id(image) not in written:
                name = f"images/{len(written):04d}.png"
                image.save(directory / name, format="PNG")
                written[id(image)] = name
            paths.append(written[id(image)])
        lines.append(json.dumps({**row, "images": paths}) + "\n")
    path = directory / "data.jsonl"
    path.write_text("".join(lines))
    return path


def read_vision_jsonl(path: str | Path) -> list[dict]:
    """Rows of a `write_vision_jsonl` file with their images opened (RGB PIL images, paths relative to the file)."""
    from PIL import Image

    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["images"] = [Image.open(path.parent / p).convert("RGB") for p in row["images"]]
    return rows


def _is_paired(rows: list[dict]) -> bool:
    return "chosen" in rows[0]


# ------------------------------------------------------------------------------------------------ models


def _load(model_dir: str | Path):
    """(model in eval mode, processor), float32, from `model_dir`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def _dataset(rows: list[dict]):
    """A datasets.Dataset of `rows`: trl decodes every row afresh, and its collators mutate what they get."""
    import datasets

    return datasets.Dataset.from_list(rows)


def _checkpointing_argument() -> str:
    """TrainingArguments' name for gradient checkpointing: activation_checkpointing from transformers 5.23."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def _common_args(output_dir: str, steps: int, batch_size: int, **settings) -> dict:
    """The TrainingArguments both oracles share; `settings` (trainer-specific and caller overrides) win."""
    return {
        "output_dir": output_dir,
        "max_steps": steps,
        "per_device_train_batch_size": batch_size,
        "gradient_accumulation_steps": 1,
        "train_sampling_strategy": "sequential",
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,  # trl's configs default bf16 to True (autocast, also on the CPU)
        "fp16": False,
        # trl's configs default gradient_checkpointing to True; transformers 5.23 renamed it (the old name warns)
        _checkpointing_argument(): False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **settings,
    }


def _train_logs(trainer) -> list[dict]:
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # disable_tqdm adds it: it would print every log entry
    trainer.train()
    return [dict(h) for h in trainer.state.log_history if "loss" in h]


def trl_kto_logs(
    model_dir: str | Path,
    rows: list[dict],
    *,
    loss_type: str = "apo_zero_unpaired",
    steps: int = 3,
    batch_size: int = 4,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    beta: float = 0.1,
    learning_rate: float = 5e-3,
    max_grad_norm: float = 0.5,
    seed: int = 0,
    **more,
) -> list[dict]:
    """trl.KTOTrainer on unpaired vision `rows`, the reference online: its per-step log_history entries.

    Each entry holds "loss", "grad_norm", "learning_rate", "rewards/chosen", "logps/chosen", "kl", "entropy",
    ... as trl logs them. Rows are taken in order, `batch_size` per step; with loss_type "kto" trl's collator pairs
    row i with row i-1's completion (within the batch, cyclically) for the KL term. `more` goes to KTOConfig.
    """
    from trl import KTOConfig, KTOTrainer

    model, processor = _load(model_dir)
    ref_model = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as out:
        args = KTOConfig(
            **_common_args(
                out,
                steps,
                batch_size,
                loss_type=loss_type,
                max_length=max_length,
                beta=beta,
                learning_rate=learning_rate,
                max_grad_norm=max_grad_norm,
                seed=seed,
                precompute_ref_log_probs=False,  # trl refuses True for vision datasets
                **more,
            )
        )
        trainer = KTOTrainer(
            model=model, ref_model=ref_model, args=args, train_dataset=_dataset(rows), processing_class=processor
        )
        return _train_logs(trainer)


def trl_dpo_logs(
    model_dir: str | Path,
    rows: list[dict],
    *,
    loss_type: str = "sigmoid",
    steps: int = 3,
    batch_size: int = 2,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    beta: float = 0.1,
    learning_rate: float = 5e-3,
    max_grad_norm: float = 0.5,
    seed: int = 0,
    **more,
) -> list[dict]:
    """trl.DPOTrainer on paired vision `rows`, the reference online: its per-step log_history entries.

    Rows are taken in order, `batch_size` per step (trl's collator stacks chosen then rejected, 2 x batch_size
    sequences, each with its image). `more` goes to DPOConfig.
    """
    from trl import DPOConfig, DPOTrainer

    model, processor = _load(model_dir)
    ref_model = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            **_common_args(
                out,
                steps,
                batch_size,
                loss_type=loss_type,
                max_length=max_length,
                truncation_mode="keep_start",  # keep_end is refused for vision datasets
                beta=beta,
                learning_rate=learning_rate,
                max_grad_norm=max_grad_norm,
                seed=seed,
                precompute_ref_log_probs=False,  # trl refuses True for vision datasets
                **more,
            )
        )
        trainer = DPOTrainer(
            model=model, ref_model=ref_model, args=args, train_dataset=_dataset(rows), processing_class=processor
        )
        return _train_logs(trainer)


# ------------------------------------------------------------------------------------------------ tokens


def _collator(processor, rows: list[dict], max_length: int | None):
    if _is_paired(rows):
        from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

        return DataCollatorForVisionPreference(processor=processor, max_length=max_length)
    from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference

    return DataCollatorForVisionUnpairedPreference(processor=processor, max_length=max_length, calculate_kl=False)


def _collate_one(collator, row: dict) -> dict:
    return collator([copy.deepcopy(row)])  # the collators rewrite the example's messages in place


def _split(input_ids, attention_mask, completion_mask) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of one collated sequence, padding dropped."""
    ids = input_ids.tolist()
    attended = attention_mask.tolist()
    completion = completion_mask.tolist()
    prompt = [t for t, a, c in zip(ids, attended, completion, strict=True) if a and not c]
    return prompt, [t for t, c in zip(ids, completion, strict=True) if c]


def trl_vision_tokens(model_dir: str | Path, rows: list[dict], max_length: int | None) -> list[dict]:
    """Per row, what trl's vision collator makes of it alone (a batch of 1), padding stripped.

    unpaired: {"prompt_ids", "completion_ids", "num_image_tokens", "label"}; paired: {"prompt_ids", "chosen_ids",
    "rejected_ids", "num_image_tokens"}. The prompt ids hold the expanded image tokens (num_image_tokens counts the
    processor's `image_token`: 16 for the tiny LLaVA; Idefics3's wrapper tokens are not counted); everything is cut
    to `max_length` as trl cuts it (keep_start on prompt + completion).
    """
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    collator = _collator(processor, rows, max_length)
    out = []
    for row in rows:
        batch = _collate_one(collator, row)
        parts = [
            _split(batch["input_ids"][k], batch["attention_mask"][k], batch["completion_mask"][k])
            for k in range(batch["input_ids"].shape[0])
        ]
        prompt_ids = parts[0][0]
        record = {"prompt_ids": prompt_ids}
        if _is_paired(rows):  # the batch of 1 holds [chosen, rejected]
            assert parts[1][0] == prompt_ids, "chosen and rejected should share the prompt"
            record |= {"chosen_ids": parts[0][1], "rejected_ids": parts[1][1]}
        else:
            record |= {"completion_ids": parts[0][1], "label": bool(row["label"])}
        record["num_image_tokens"] = prompt_ids.count(image_token_id)
        out.append(record)
    return out


def reference_logps(model_dir: str | Path, rows: list[dict], max_length: int | None) -> list:
    """Per row, the summed completion log-prob under the (unpatched) model from `model_dir`, from the full logits.

    Each row is collated alone by trl's vision collator (so the sequence is trl's, cut to `max_length`) and scored
    with `log_softmax(logits[:, :-1]).gather(...)` over the completion mask. unpaired rows give a float each;
    paired rows a (chosen, rejected) tuple.
    """
    model, processor = _load(model_dir)
    collator = _collator(processor, rows, max_length)
    out = []
    with torch.no_grad():
        for row in rows:
            batch = _collate_one(collator, row)
            completion_mask = batch.pop("completion_mask")
            batch.pop("label", None)
            inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
            logits = model(**inputs, use_cache=False).logits.float()
            ids = inputs["input_ids"]
            token_logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            sums = (token_logps * completion_mask[:, 1:]).sum(-1).tolist()
            out.append(tuple(sums) if _is_paired(rows) else sums[0])
    return out


# ------------------------------------------------------------------------------------------------ self-check


def _self_check() -> None:
    import time

    from kto_pipeline.demo.tiny_vision import save_tiny_vlm

    def show(name, logs, keys):
        print(f"{name}:")
        for h in logs:
            print("  ", {k: round(h[k], 5) for k in keys if k in h})

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_vlm("llava", Path(tmp) / "llava")
        rows, pairs = vision_rows(12), vision_rows(6, seed=1, paired=True)
        max_length = DEFAULT_MAX_LENGTH

        # 2. jsonl round trip: relative paths, identical pixels, shared images written once
        path = write_vision_jsonl(rows, Path(tmp) / "data")
        back = read_vision_jsonl(path)
        first = json.loads(path.read_text().splitlines()[0])
        assert not Path(first["images"][0]).is_absolute()
        assert len(list((Path(tmp) / "data" / "images").iterdir())) < len(rows)
        assert all(a["images"][0].tobytes() == b["images"][0].tobytes() for a, b in zip(rows, back, strict=True))
        print("jsonl:", path.name, first["images"], first["completion"])

        # 5. trl's tokens
        tokens = trl_vision_tokens(model_dir, rows, max_length)
        full = trl_vision_tokens(model_dir, rows, None)
        for t, f in zip(tokens, full, strict=True):
            assert t["num_image_tokens"] == 16 and t["prompt_ids"] == f["prompt_ids"]
            assert f["completion_ids"][: len(t["completion_ids"])] == t["completion_ids"]
        truncated = sum(len(t["completion_ids"]) < len(f["completion_ids"]) for t, f in zip(tokens, full, strict=True))
        print("prompt lengths", [len(t["prompt_ids"]) for t in tokens])
        print("completion lengths", [len(t["completion_ids"]) for t in tokens], f"({truncated} truncated)")
        assert truncated > 0
        paired_tokens = trl_vision_tokens(model_dir, pairs, max_length)
        print("paired chosen/rejected lengths", [(len(t["chosen_ids"]), len(t["rejected_ids"])) for t in paired_tokens])

        # 6. independent reference log-probs
        ref = reference_logps(model_dir, rows, max_length)
        print("reference logps", [round(x, 3) for x in ref])
        paired_ref = reference_logps(model_dir, pairs, max_length)
        print("paired reference logps", [tuple(round(x, 3) for x in p) for p in paired_ref])

        # 3. KTO, both loss types; 4. DPO
        keys = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"]
        for loss_type in ("apo_zero_unpaired", "kto"):
            logs = trl_kto_logs(model_dir, rows, loss_type=loss_type, max_length=max_length)
            show(f"KTO {loss_type}", logs, keys)
            assert len(logs) == 3 and abs(logs[0]["rewards/chosen"]) < 1e-6 and abs(logs[0]["rewards/rejected"]) < 1e-6
            assert abs(logs[-1]["loss"] - logs[0]["loss"]) > 1e-2
            assert max(h["grad_norm"] for h in logs) > 0.5  # clipping exercised
            # step 1: policy == reference, so trl's logps/chosen is the mean of our independent values (rows 0-3)
            first = [(x, r["label"]) for x, r in zip(ref[:4], rows[:4], strict=True)]
            chosen = [x for x, label in first if label]
            rejected = [x for x, label in first if not label]
            assert abs(logs[0]["logps/chosen"] - sum(chosen) / len(chosen)) < 1e-4 * abs(logs[0]["logps/chosen"])
            assert abs(logs[0]["logps/rejected"] - sum(rejected) / len(rejected)) < 1e-4 * abs(
                logs[0]["logps/rejected"]
            )
        dpo = trl_dpo_logs(model_dir, pairs, max_length=max_length)
        show("DPO sigmoid", dpo, ["loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen"])
        assert abs(dpo[0]["rewards/chosen"]) < 1e-6 and abs(dpo[-1]["loss"] - dpo[0]["loss"]) > 1e-2
        for name, k in (("logps/chosen", 0), ("logps/rejected", 1)):  # step 1: the mean over pairs 0-1
            expected = (paired_ref[0][k] + paired_ref[1][k]) / 2
            assert abs(dpo[0][name] - expected) < 1e-4 * abs(expected), (name, dpo[0][name], expected)
    print(f"self-check passed in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    _self_check()
