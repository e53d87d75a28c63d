"""`kto-pipeline generate`: the reference's and the trained policy's answers to the same prompts, side by side;
or, with --num-return-sequences (rounds), sampled completions of a prompts file by the policy alone, as dataset
rows to label.

Metrics say that the rewards moved; reading answers says whether the model got better. Like trl's
`generate_during_eval`, but written to RUN/samples.jsonl (which `kto-pipeline report` shows) instead of
an online dashboard.

Prompts come from a precompute cache by default: its `prompt_ids` are exactly what the run trained or
was evaluated on (chat template and generation prompt included), so nothing is re-tokenized, and the
dataset's labelled completions of each prompt can be shown next to the two answers. A prompt shared by
several rows (paired data: a desirable and an undesirable one) is answered once.

The two models are loaded one after the other (peak memory: one model), and decode by this command's
settings alone: the models' own generation_config sampling defaults are replaced, so both answer in the
same way and the file records how.

Rounds (`generate_completions`): each row of --prompts gets N sampled completions from the policy (the reference
is not loaded), written as unpaired dataset rows (`prompt` exactly as in the file, `completion`, `label`,
`policy`, `sample_index`, `generation`, and the prompts row's other keys), with `label` null, or set by the
user's function (--label-with, kto_pipeline/label.py). Labelled rows are ready for `precompute --append`.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kto_pipeline import __version__
from kto_pipeline.config import GenerateConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.rundir import SAMPLES_FILE, finished_at, read_samples, run_config

SIDE_BY_SIDE_PROMPTS = 8  # --num-prompts' default side by side (rounds answer every row of --prompts)
COMPLETIONS_FILE = "rounds/completions.jsonl"  # rounds' default --output, under the run
WRITTEN_KEYS = ("completion", "label", "policy", "sample_index", "generation")  # a rounds row's own keys


@dataclass
class Prompt:
    """One prompt; from a cache also its first row's id and label, and every row's (label, completion); from a
    file, the row as read and its line number."""

    ids: list[int]
    example_id: int | None = None
    label: bool | None = None
    completions: list[tuple[bool, list[int]]] = field(default_factory=list)
    row: dict[str, Any] | None = None
    line: int | None = None


# ------------------------------------------------------------------------------------------ prompts


def cache_prompts(table, num_prompts: int) -> list[Prompt]:
    """The first `num_prompts` distinct prompts of a cache table, in cache order, each with every row that
    shares it (anywhere in the cache).

    Finding those rows reads only the prompt lengths and, for rows of a chosen prompt's length, their tokens
    (vectorized over each memory-mapped record batch), so a cache of millions of rows is one cheap pass.
    """
    import numpy as np
    import pyarrow.compute as pc

    chosen: dict[tuple[int, ...], Prompt] = {}
    for batch in table.select(["example_id", "label", "prompt_ids"]).to_batches():
        for example_id, label, ids in zip(*(batch.column(i).to_pylist() for i in range(3)), strict=True):
            if tuple(ids) not in chosen:
                chosen[tuple(ids)] = Prompt(list(ids), example_id, bool(label))
                if len(chosen) == num_prompts:
                    break
        if len(chosen) == num_prompts:
            break

    by_length: dict[int, list[tuple[Prompt, Any]]] = {}
    for key, prompt in chosen.items():
        by_length.setdefault(len(key), []).append((prompt, np.asarray(key)))
    for batch in table.select(["label", "prompt_ids", "completion_ids"]).to_batches():
        prompts = batch.column(1)
        lengths = pc.list_value_length(prompts).to_numpy(zero_copy_only=False)
        # `offsets` index into `values`, the unsliced child array, so the pair is consistent for any batch
        offsets, values = prompts.offsets.to_numpy(), prompts.values.to_numpy()
        for length, group in by_length.items():
            rows = np.flatnonzero(lengths == length)
            if len(rows) == 0:
                continue
            tokens = values[offsets[rows][:, None] + np.arange(length)]  # (rows, length)
            for prompt, key in group:
                for row in rows[(tokens == key).all(axis=1)]:
                    prompt.completions.append((bool(batch.column(0)[row].as_py()), batch.column(2)[row].as_py()))
    return list(chosen.values())


def file_prompts(path: Path, tokenizer, num_prompts: int | None, distinct: bool = True) -> list[Prompt]:
    """The first `num_prompts` (all: None) distinct prompts of a .jsonl file, or with `distinct=False` its first
    rows, repeats kept: strings are tokenized as precompute does, message lists rendered with the chat template
    and the generation prompt."""
    from kto_pipeline.stages.precompute.data import chat_ids, is_conversational

    if not path.is_file():
        raise KTOPipelineError(f"--prompts {path}: no such file. Pass a .jsonl file whose rows have `prompt`.")
    prompts: dict[Any, Prompt] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"--prompts {path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KTOPipelineError(f"{where}: not valid JSON ({exc.msg}).") from exc
            if not isinstance(row, dict) or "prompt" not in row:
                raise KTOPipelineError(f'{where}: no "prompt" key; each line must be an object with "prompt".')
            value = row["prompt"]
            if isinstance(value, str):
                ids = list(tokenizer(value)["input_ids"])
            elif is_conversational(value):
                if tokenizer.chat_template is None:
                    raise KTOPipelineError(
                        f"{where}: the prompt is a list of messages, but the run's tokenizer has no chat template. "
                        "Use plain-string prompts."
                    )
                ids = chat_ids(tokenizer, value, row, add_generation_prompt=True)
            else:
                raise KTOPipelineError(
                    f'{where}: "prompt" must be a string or a list of {{role, content}} messages, '
                    f"got {type(value).__name__}."
                )
            if not ids:
                raise KTOPipelineError(f"{where}: the prompt is empty (no tokens); there is nothing to answer.")
            prompts.setdefault(tuple(ids) if distinct else lineno, Prompt(ids, row=row, line=lineno))
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise KTOPipelineError(f"--prompts {path} holds no prompts.")
    return list(prompts.values())


# --------------------------------------------------------------------------------------- generation


def _eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS and the model's own (a chat model may end a turn with another token)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = model.generation_config.eos_token_id
    for i in extra if isinstance(extra, list) else [extra]:
        if i is not None and i not in ids:
            ids.append(i)
    return ids


def generate_answers(
    model, tokenizer, prompts: list[list[int]], config: GenerateConfig, desc: str, strip: bool = True
) -> list[str]:
    """Each prompt's answer (decoded, special tokens dropped, stripped unless `strip=False`), in prompt order.

    Prompts are batched longest first and left-padded, so every answer continues its prompt's last token.
    The seed is set afresh for each call: two identical models give identical answers, sampled or greedy.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": 0} if config.sampling else {}
    generation = GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        do_sample=config.sampling,
        eos_token_id=eos,
        pad_token_id=pad_id,
        use_cache=True,  # a trained run's config.json says use_cache=False (training needs no KV cache)
        **sampling,
    )
    # generate() fills unset values from the model's generation_config: replace it, so no model default applies
    model.generation_config = generation

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    batches = [order[i : i + config.batch_size] for i in range(0, len(order), config.batch_size)]
    answers = [""] * len(prompts)
    rng_devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.inference_mode(), torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(config.seed)
        for batch in tqdm(batches, desc=desc, unit="batch"):
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, T)
            attention_mask = torch.zeros_like(input_ids)  # (B, T), 0 on the left padding
            for row, i in enumerate(batch):
                input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                attention_mask[row, width - len(prompts[i]) :] = 1
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=generation
            )  # (B, T + new tokens)
            for row, i in enumerate(batch):
                new = out[row, width:].tolist()
                end = next((k for k, t in enumerate(new) if t in eos), len(new))
                answer = tokenizer.decode(new[:end], skip_special_tokens=True)
                answers[i] = answer.strip() if strip else answer
    return answers


# ------------------------------------------------------------------------------------------ command


def _check_run(run: Path) -> None:
    if not run.exists():
        raise KTOPipelineError(f"--run {run}: no such directory. Pass a `kto-pipeline train --output-dir`.")
    if not run.is_dir():
        raise KTOPipelineError(f"--run {run} is a file. Pass a `kto-pipeline train --output-dir`.")
    if not ((run / "config.json").exists() or (run / "adapter_config.json").exists()):
        raise KTOPipelineError(
            f"--run {run}: no saved model here (no config.json nor adapter_config.json). Pass a finished "
            "`kto-pipeline train --output-dir` (a sweep with --keep best keeps only the best run's model)."
        )


def _resolve_reference(config: GenerateConfig, saved: dict[str, Any]) -> tuple[str, str | None]:
    """(reference model, revision): --reference, else the reference model of the cache the run trained on."""
    from kto_pipeline.cache import read_manifest

    if config.reference is not None:
        return config.reference, None
    if not saved.get("cache"):
        raise KTOPipelineError(
            f"--run {config.run} has no run_config.json naming the cache it trained on, so its reference model is "
            "unknown. Pass --reference MODEL."
        )
    try:
        manifest = read_manifest(saved["cache"])
    except KTOPipelineError as exc:
        raise KTOPipelineError(
            f"the cache the run trained on ({saved['cache']}, from its run_config.json) names the reference model, "
            f"but it cannot be read: {exc} Pass --reference MODEL."
        ) from exc
    return manifest.reference_model, manifest.reference_revision


def _resolve_source(config: GenerateConfig, saved: dict[str, Any]) -> tuple[str, str]:
    """("cache" or "prompts", path): --prompts, --cache, else the run's --eval-cache."""
    if config.prompts is not None:
        return "prompts", config.prompts
    if config.cache is not None:
        return "cache", config.cache
    if saved.get("eval_cache"):
        return "cache", saved["eval_cache"]
    raise KTOPipelineError(
        "no prompts to answer: the run was trained without --eval-cache, so pass --cache CACHE (a precompute "
        "cache, e.g. of a held-out split) or --prompts FILE.jsonl."
    )


def _one_process_device():
    from kto_pipeline.runtime.launch import one_process_device

    return one_process_device("generate", "it loads each model whole on one device and writes one file")


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def generate_samples(config: GenerateConfig) -> Path:
    """Answer the same prompts with the reference and the policy of `config.run`; returns the samples file.
    With `config.num_return_sequences` this is `generate_completions`."""

    from kto_pipeline.cache import open_cache
    from kto_pipeline.files import atomic_write_text, tokenizer_hash
    from kto_pipeline.models import load_model, load_tokenizer, resolve_dtype

    if config.rounds:
        return generate_completions(config)
    device = _one_process_device()
    print(f"kto-pipeline generate {__version__}\n{config.describe()}", flush=True)
    run = Path(config.run)
    _check_run(run)
    out = Path(config.output) if config.output else run / SAMPLES_FILE
    if out.is_dir():
        raise KTOPipelineError(f"--output {out} is a directory. Pass a file path (e.g. {out / SAMPLES_FILE}).")
    saved = run_config(run)
    kind, source = _resolve_source(config, saved)
    reference, revision = _resolve_reference(config, saved)

    # Prompts are token ids, so every model and the cache must share the run's tokenizer.
    tokenizer = load_tokenizer(config.run, trust_remote_code=config.trust_remote_code, flag="--run")
    run_tokenizer = tokenizer_hash(tokenizer)
    ref_tokenizer = load_tokenizer(reference, revision, config.trust_remote_code, flag="--reference")
    if tokenizer_hash(ref_tokenizer) != run_tokenizer:
        raise KTOPipelineError(
            f"the tokenizer of the reference {reference} differs from the run's (vocabulary, special tokens or chat "
            "template): the same token ids would be different text to the two models. Pass a --reference that "
            "shares the run's tokenizer."
        )
    if kind == "cache":
        cache = open_cache(source)
        if cache.manifest.tokenizer_hash != run_tokenizer:
            raise KTOPipelineError(
                f"cache {source} was made with another tokenizer than the run's, so its prompt token ids are other "
                "text to these models. Use a cache precomputed with the run's reference model, or --prompts."
            )
        prompts = cache_prompts(cache.table, config.num_prompts or SIDE_BY_SIDE_PROMPTS)
    else:
        prompts = file_prompts(Path(source), tokenizer, config.num_prompts or SIDE_BY_SIDE_PROMPTS)

    dtype = resolve_dtype(config.dtype, device)
    answers: dict[str, list[str]] = {}
    # one model at a time: the reference is freed before the policy is loaded
    for role, name, rev, flag in (
        ("reference", reference, revision, "--reference"),
        ("policy", config.run, None, "--run"),
    ):
        model = load_model(name, dtype, rev, config.trust_remote_code, flag=flag).eval().to(device)
        answers[role] = generate_answers(model, tokenizer, [p.ids for p in prompts], config, f"generate ({role})")
        del model
        _free(device)

    settings = {
        **{k: v for k, v in config.to_dict().items() if k not in ("output", "cache", "prompts", "reference")},
        "num_prompts": config.num_prompts or SIDE_BY_SIDE_PROMPTS,
        "do_sample": config.sampling,
        "reference": reference,
        "reference_revision": revision,
        kind: source,
        "dtype": str(dtype).removeprefix("torch."),
        "kto_pipeline_version": __version__,
    }
    lines = []
    for prompt, ref_answer, policy_answer in zip(prompts, answers["reference"], answers["policy"], strict=True):
        # the prompt keeps its special tokens, so the chat format the models saw is visible
        record: dict[str, Any] = {
            "prompt": tokenizer.decode(prompt.ids, skip_special_tokens=False),
            "reference": ref_answer,
            "policy": policy_answer,
        }
        if prompt.example_id is not None:
            record["example_id"] = prompt.example_id
            record["label"] = prompt.label
            record["dataset_completions"] = [
                {"label": label, "text": tokenizer.decode(ids, skip_special_tokens=True).strip()}
                for label, ids in prompt.completions
            ]
        record["settings"] = settings
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(lines))
    return out


# ------------------------------------------------------------------------------------------ rounds


def generate_completions(config: GenerateConfig) -> Path:
    """`config.num_return_sequences` sampled completions of each row of `config.prompts` by the policy of
    `config.run` alone, written as dataset rows (labelled by `config.label_with` if given); returns the file.

    Every check that needs no model (the run, the output, the labeller, the prompts) comes before the policy is
    loaded, and the file is written whole at the end (temporary file, then rename), so a failure leaves none."""

    from kto_pipeline.files import atomic_write_text
    from kto_pipeline.label import check_output, label_rows, load_labeller, rows_text
    from kto_pipeline.models import load_model, load_tokenizer, resolve_dtype

    device = _one_process_device()
    print(f"kto-pipeline generate {__version__}\n{config.describe()}", flush=True)
    run = Path(config.run)
    _check_run(run)
    out = Path(config.output) if config.output else run / COMPLETIONS_FILE
    check_output(out, config.overwrite)
    labeller = load_labeller(config.label_with) if config.label_with else None
    tokenizer = load_tokenizer(config.run, trust_remote_code=config.trust_remote_code, flag="--run")
    prompts = file_prompts(Path(config.prompts), tokenizer, config.num_prompts, distinct=False)

    n = config.num_return_sequences
    dtype = resolve_dtype(config.dtype, device)
    model = load_model(config.run, dtype, None, config.trust_remote_code, flag="--run").eval().to(device)
    # each prompt n times, side by side in the batches: the copies draw different samples
    texts = generate_answers(
        model, tokenizer, [p.ids for p in prompts for _ in range(n)], config, "generate (policy)", strip=False
    )
    del model

    policy = {"run": str(run.resolve()), "global_step": finished_at(run)}
    generation = {
        "do_sample": config.sampling,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
        "batch_size": config.batch_size,
        "dtype": str(dtype).removeprefix("torch."),
        "kto_pipeline_version": __version__,
    }
    rows, where = [], []
    for i, prompt in enumerate(prompts):
        source = prompt.row
        extra = {k: v for k, v in source.items() if k != "prompt" and k not in WRITTEN_KEYS}
        for k in range(n):
            text = texts[i * n + k]
            completion = [{"role": "assistant", "content": text}] if isinstance(source["prompt"], list) else text
            rows.append(
                {
                    "prompt": source["prompt"],
                    **extra,
                    "completion": completion,
                    "label": None,
                    "policy": policy,
                    "sample_index": k,
                    "generation": generation,
                }
            )
            where.append(f"row {len(rows) - 1} (--prompts line {prompt.line}, sample {k})")
    if labeller is not None:
        label_rows(rows, labeller, config.label_with, where)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, rows_text(rows))
    return out


def completions_preview(path: str | Path, count: int = 2, width: int = 100) -> str:
    """A few lines for the terminal: rows, labels and the next step, and the first `count` rows, shortened."""
    from kto_pipeline.label import label_counts, read_rows

    rows = [row for _, row in read_rows(Path(path), "the completions file")]
    prompts = len({json.dumps(row["prompt"]) for row in rows})
    lines = [f"{len(rows)} rows: completions of {prompts} prompts; {label_counts(rows)}"]
    if any(row.get("label") is None for row in rows):
        lines.append(
            f"  label them before `precompute --append`: kto-pipeline label {path} --label-with MODULE:FUNCTION "
            '--output OUT.jsonl, or set each "label" to true/false by hand'
        )
    for i, row in enumerate(rows[:count], start=1):
        completion = row["completion"]
        text = completion[0]["content"] if isinstance(completion, list) else completion
        shown = text.replace("\n", "\\n")
        shown = shown if len(shown) <= width else shown[: width - 3] + "..."
        lines.append(f"  [{i}] label {json.dumps(row.get('label'))}: {shown}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ preview


def preview(path: str | Path, count: int = 2, width: int = 100) -> str:
    """A few lines for the terminal: how many answers changed, and the first `count` samples, shortened."""

    def short(text: str) -> str:
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    records = read_samples(path)
    changed = sum(r["policy"] != r["reference"] for r in records)
    lines = [f"{len(records)} prompts; the policy's answer differs from the reference's on {changed}"]
    for i, record in enumerate(records[:count], start=1):
        lines += [f"  [{i}] {key:<9} {short(record[key])}" for key in ("prompt", "reference", "policy")]
    return "\n".join(lines)
