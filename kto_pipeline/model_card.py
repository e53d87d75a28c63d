"""The model card of a trained policy: OUT/README.md in the Hugging Face Hub's format.

    ---
    base_model, datasets, library_name, model_name, tags      YAML metadata the Hub indexes
    ---
    what it is, how to load it, the training settings, the cache it trained on, results,
    framework versions, citation                               Markdown for people

As trl's trainers do (trl/trainer/utils.py `generate_model_card`), but the card also records what
only this pipeline knows: the cache's reference model and dataset hashes, so a reader can tell
which reference the rewards are measured against. `build_model_card` is a pure function of the
run's config, the cache manifest and the metrics history (library versions aside); `write_model_card`
puts it in a directory.

The Hub rejects metadata that names a local path as `base_model` or `datasets`, so those keys hold
hub ids only (trl does the same); local paths are named in the body instead. A local base model whose
own card declares a hub `base_model` (a downloaded or converted copy) passes that id on.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kto_pipeline.cache import Manifest
from kto_pipeline.objectives import objective_for
from kto_pipeline.objectives.base import Objective
from kto_pipeline.objectives.pairs import PAIR_LOSS_NAMES
from kto_pipeline.quantization import Quantization

CARD_FILE = "README.md"
QUESTION = "If you could visit any place in the world for one day, where would you go and why?"
TRAIN_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "kl",
    "logps/chosen",
    "logps/rejected",
)
EVAL_METRICS = (
    "eval_loss",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_rewards/margins",
    "eval_rewards/accuracies",
    "eval_kl",
    "eval_logps/chosen",
    "eval_logps/rejected",
)
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")


def _num(value: Any) -> str:
    """A number as a card shows it: floats to 4 significant digits, the rest as written."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _code(value: Any) -> str:
    """A name or value as code, or "-" for none."""
    return f"`{value}`" if value not in (None, "") else "-"


# ------------------------------------------------------------------------------ what a card says of a loss family

KTO_PAPER = {
    "title": "KTO: Model Alignment as Prospect Theoretic Optimization",
    "short": "KTO",
    "id": "2402.01306",
    "citation": (
        "@article{ethayarajh2024kto,\n"
        "    title        = {{KTO: Model Alignment as Prospect Theoretic Optimization}},\n"
        "    author       = {Kawin Ethayarajh and Winnie Xu and Niklas Muennighoff and Dan Jurafsky and Douwe Kiela},\n"
        "    year         = 2024,\n"
        "    eprint       = {arXiv:2402.01306},\n"
        "}"
    ),
}


DPO_PAPER = {
    "title": "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
    "short": "DPO",
    "id": "2305.18290",
    "citation": (
        "@inproceedings{rafailov2023direct,\n"
        "    title        = {{Direct Preference Optimization: Your Language Model is Secretly a Reward Model}},\n"
        "    author       = {Rafael Rafailov and Archit Sharma and Eric Mitchell and Christopher D. Manning and "
        "Stefano Ermon and Chelsea Finn},\n"
        "    year         = 2023,\n"
        "    booktitle    = {Advances in Neural Information Processing Systems 36 (NeurIPS 2023)},\n"
        "}"
    ),
}


def _paper_link(paper: dict[str, str]) -> str:
    """[title](its page on the Hub) of a paper with an arXiv id."""
    return f"[{paper['title']}](https://huggingface.co/papers/{paper['id']})"


def _kto_sentence(config: dict[str, Any], what: str, source: str) -> str:
    return (
        f"{what}, trained with KTO ({_paper_link(KTO_PAPER)}), loss {_code(config['loss_type'])}, on binary "
        f"feedback (each completion marked desirable or undesirable) from {source}."
    )


def _kto_rows(config: dict[str, Any], options: dict[str, Any]) -> list[tuple[str, str]]:
    """The family's options in one row (its two weights: "desirable_weight / undesirable_weight", "1 / 1.33")."""
    return [(" / ".join(options), " / ".join(_num(config[name]) for name in options))]


def _pairs_sentence(config: dict[str, Any], what: str, source: str) -> str:
    loss_type = config["loss_type"]
    name = " + ".join(PAIR_LOSS_NAMES[t] for t in loss_type.split("+"))
    weights = f", weights {config['loss_weights'].replace(',', ', ')}" if config.get("loss_weights") else ""
    return (
        f"{what}, trained with the pair loss {name} ({_code(loss_type)}{weights}) (trl.DPOTrainer's; after DPO, "
        f"{_paper_link(DPO_PAPER)}) on (chosen, rejected) answer pairs from {source}."
    )


def _pairs_rows(config: dict[str, Any], options: dict[str, Any]) -> list[tuple[str, str]]:
    """The family's options that differ from their defaults."""
    changed = {name: config.get(name, default) for name, default in options.items()}
    return [
        (name, _code(value) if isinstance(value, str) else _num(value))
        for name, value in changed.items()
        if value != options[name]
    ]


@dataclass(frozen=True)
class FamilyCard:
    """What a card says of a loss family (an `Objective`'s name): the paper it cites, its tag, its first sentence
    (`what`, the model, trained with the run's loss on the data at `source`) and the rows of the family's own
    settings (from its `options` and their defaults)."""

    paper: dict[str, str]
    tag: str
    sentence: Callable[[dict[str, Any], str, str], str]
    rows: Callable[[dict[str, Any], dict[str, Any]], list[tuple[str, str]]]


FAMILY_CARDS = {
    "kto": FamilyCard(KTO_PAPER, "kto", _kto_sentence, _kto_rows),
    "pairs": FamilyCard(DPO_PAPER, "dpo", _pairs_sentence, _pairs_rows),
}


def is_hub_id(name: str | None) -> bool:
    """True when `name` reads as a Hub repo id ("org/name" or "name") and is not a local file or directory."""
    if not name:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not name.lower().endswith(_DATA_SUFFIXES) and not Path(name).expanduser().exists()


def hub_base_model(name: str | None) -> str | None:
    """The hub id to record as `base_model`: `name` itself, or for a local model directory the `base_model` its own
    card declares (a local copy or conversion of a hub model, e.g. the demo's SmolLM2 dequantized from GGUF)."""
    if is_hub_id(name):
        return name
    card = Path(name).expanduser() / CARD_FILE if name else None
    if card is None or not card.is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        declared = ModelCard.load(card).data.base_model
    except Exception:  # a README that is not a model card
        return None
    return declared if isinstance(declared, str) and is_hub_id(declared) else None


def framework_versions(peft: bool) -> dict[str, str]:
    """The installed versions of the libraries a run depends on (as trl's card lists them)."""
    from kto_pipeline import __version__

    packages = {
        "Transformers": "transformers",
        "PyTorch": "torch",
        "Datasets": "datasets",
        "Accelerate": "accelerate",
        "Tokenizers": "tokenizers",
    }
    if peft:
        packages["PEFT"] = "peft"
    versions = {"kto-pipeline": __version__}
    for label, package in packages.items():
        try:
            versions[label] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


# ------------------------------------------------------------------------------------------ formatting


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    lines += [f"| {cell(k)} | {cell(v)} |" for k, v in rows]
    return "\n".join(lines)


def _link(name: str, kind: str = "") -> str:
    """A Hub link for a hub id, else the name as code (a local path means nothing to a reader elsewhere)."""
    return f"[{name}](https://huggingface.co/{kind}{name})" if is_hub_id(name) else _code(name)


def _last(history: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return next((r for r in reversed(history) if key in r), None)


# ------------------------------------------------------------------------------------------ sections


def _loading_snippet(model_path: str, adapter: bool, chat_template: bool, trust_remote_code: bool) -> str:
    """Python that loads the model from `model_path` and generates one answer (the test runs it)."""
    remote = ", trust_remote_code=True" if trust_remote_code else ""
    load_kwargs = f'dtype="auto", device_map="auto"{remote}'
    if not chat_template and not adapter:  # a base model without a chat template: plain text in, as trl's card
        return "\n".join(
            [
                "from transformers import pipeline",
                "",
                f'model_id = "{model_path}"  # or the Hub repo id this folder is uploaded to',
                f'generator = pipeline("text-generation", model=model_id, {load_kwargs})',
                f'prompt = "{QUESTION}"',
                'print(generator(prompt, max_new_tokens=128, return_full_text=False)[0]["generated_text"])',
            ]
        )
    if adapter:
        imports = ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer"]
        load = [
            f"model = AutoPeftModelForCausalLM.from_pretrained(model_id, {load_kwargs})  # base model + adapters",
            "# model = model.merge_and_unload()  # optional: fold the adapters into the weights for faster inference",
        ]
    else:
        imports = ["from transformers import AutoModelForCausalLM, AutoTokenizer"]
        load = [f"model = AutoModelForCausalLM.from_pretrained(model_id, {load_kwargs})"]
    if chat_template:
        encode = [
            f'messages = [{{"role": "user", "content": "{QUESTION}"}}]',
            "inputs = tokenizer.apply_chat_template(",
            '    messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"',
            ").to(model.device)",
        ]
    else:
        encode = [f'inputs = tokenizer("{QUESTION}", return_tensors="pt").to(model.device)']
    return "\n".join(
        [
            *imports,
            "",
            f'model_id = "{model_path}"  # or the Hub repo id this folder is uploaded to',
            f"tokenizer = AutoTokenizer.from_pretrained(model_id{remote})",
            *load,
            "",
            *encode,
            "output = model.generate(**inputs, max_new_tokens=128)",
            'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))',
        ]
    )


def _settings_rows(
    config: dict[str, Any],
    objective: Objective,
    cached_max: int,
    steps_run: int | None,
    num_processes: int | None,
    precision: str | None,
):
    per_device, accumulation = config["per_device_train_batch_size"], config["gradient_accumulation_steps"]
    unit = objective.unit
    if num_processes:
        batch = f"{per_device} x {accumulation} x {num_processes} = {per_device * accumulation * num_processes} {unit}"
        batch_name = "batch (per device x accumulation x processes)"
    else:
        batch, batch_name = f"{per_device} x {accumulation} = {per_device * accumulation} {unit} per process", "batch"
    if precision is None:
        precision = "fp16" if config.get("fp16") else {True: "bf16", False: "fp32"}.get(config.get("bf16"), "auto")
    length = config.get("max_length")
    duration = "max_steps" if config["max_steps"] > 0 else "num_train_epochs"
    optimizer = f"AdamW, weight_decay {_num(config['weight_decay'])}, max_grad_norm {_num(config['max_grad_norm'])}"
    options = FAMILY_CARDS[objective.name].rows(config, objective.options)
    rows = [
        ("loss_type", _code(config["loss_type"])),
        ("beta", _num(config["beta"])),
        *options,
        ("learning_rate", f"{config['learning_rate']:g}"),
        ("lr_scheduler_type", _code(config["lr_scheduler_type"])),
        ("warmup_ratio", _num(config["warmup_ratio"])),
        ("optimizer", optimizer),
        (batch_name, batch),
        (duration, _num(config[duration])),
        ("optimizer steps run", _num(steps_run) if steps_run is not None else "-"),
        ("max_length", _num(length) if length else f"{cached_max} (the cached one)"),
        ("precision", {"no": "fp32"}.get(precision, precision)),
    ]
    if config.get("lora_r") is not None:
        rows.append(
            (
                "LoRA r / alpha / dropout / targets",
                f"{config['lora_r']} / {config['lora_alpha']} / {_num(config['lora_dropout'])} / "
                f"{_code(config['lora_target_modules'])}",
            )
        )
    rows += [("train_sampling_strategy", _code(config["train_sampling_strategy"])), ("seed", _num(config["seed"]))]
    return rows


def _cache_rows(config: dict[str, Any], manifest: Manifest) -> list[tuple[str, str]]:
    ref, tok, data = manifest.reference, manifest.tokenizer, manifest.dataset
    settings, counts = manifest.settings, manifest.counts
    dropped = counts.get("dropped") or {}
    n_dropped = sum(dropped.values())
    revision = f" (revision {_code(ref['revision'])})" if ref.get("revision") else ""
    dataset = _link(data["name_or_path"], "datasets/")
    if data.get("config"):
        dataset += f", config {_code(data['config'])}"
    return [
        ("cache", _code(config["cache"])),
        ("reference model", f"{_link(ref['name_or_path'])}{revision}, {ref.get('architecture', '-')}"),
        ("reference weights hash", _code(ref.get("weights_hash"))),
        ("tokenizer hash", _code(tok.get("hash"))),
        ("dataset", dataset),
        ("split", _code(data.get("split"))),
        ("dataset content hash", _code(data.get("content_hash"))),
        ("rows (desirable / undesirable)", f"{counts['rows']} ({counts['desirable']} / {counts['undesirable']})"),
        *([("(chosen, rejected) pairs", _num(manifest.pairs["complete"]))] if manifest.paired else []),
        ("rows dropped", f"{n_dropped} ({', '.join(f'{k}: {v}' for k, v in dropped.items())})" if n_dropped else "0"),
        ("cached max_length", _num(settings["max_length"])),
        ("reference dtype", _code(settings.get("dtype"))),
        *(
            [("reference quantization (QLoRA base)", Quantization.describe(ref["quantization"]))]
            if ref.get("quantization")
            else []
        ),
        ("KL pairing seed", _num(settings.get("kl_seed"))),
        *_segment_rows(manifest),
        ("cache format version", _num(manifest.format_version)),
        ("written by", f"kto-pipeline {manifest.tool_version}"),
    ]


def _segment_rows(manifest: Manifest) -> list[tuple[str, str]]:
    """The cache's segments (a cache grown by `precompute --append`), when there is more than one."""
    if len(manifest.segments) < 2:
        return []
    return [
        (
            f"segment {seg['index']}",
            f"{seg['rows']} rows from {_code(seg['source']['name_or_path'])} ({_code(seg['source']['content_hash'])}), "
            f"written {seg.get('written_at') or '-'}",
        )
        for seg in manifest.segments
    ]


def _results(config: dict[str, Any], history: list[dict[str, Any]]) -> str:
    parts = []
    final = _last(history, "loss")
    if final is None:
        parts.append("No training metrics were logged.")
    else:
        parts.append(
            f"Training metrics logged at the last step ({final.get('step', '?')}, epoch {_num(final.get('epoch'))}),"
            f" averaged over its logging interval (`logging_steps` {config.get('logging_steps')}). Rewards are "
            "beta x (policy - reference) log-prob of the completion (for a pair loss, of the chosen and of the "
            "rejected answer of each pair); the full history is in `metrics.jsonl` and "
            "`trainer_state.json` in the run's output folder.\n\n"
            + _table(("metric", "value"), [(k, _num(final[k])) for k in TRAIN_METRICS if k in final])
        )
    evaluated = _last(history, "eval_reward_accuracy")
    if evaluated is None:
        parts.append("No held-out evaluation was run (train with `--eval-cache` to add one).")
    else:
        accuracy = f"{100 * evaluated['eval_reward_accuracy']:.1f}%"
        rows = [("eval_reward_accuracy", accuracy), ("eval_rows", _num(evaluated.get("eval_rows")))]
        pairs = ""
        if "eval_pair_accuracy" in evaluated:
            pair_accuracy = f"{100 * evaluated['eval_pair_accuracy']:.1f}%"
            rows += [("eval_pair_accuracy", pair_accuracy), ("eval_pairs", _num(evaluated.get("eval_pairs")))]
            pairs = (
                f" Of {_num(evaluated.get('eval_pairs'))} (desirable, undesirable) answer pairs to the same prompt, "
                f"the desirable answer has the higher reward in **{pair_accuracy}** (50% = chance)."
            )
        rows += [(k, _num(evaluated[k])) for k in EVAL_METRICS if k in evaluated]
        parts.append(
            f"Held-out evaluation at step {evaluated.get('step', '?')} on the cache {_code(config.get('eval_cache'))}: "
            f"the implicit reward has the sign of the label (desirable > 0 > undesirable) for **{accuracy}** of "
            f"{_num(evaluated.get('eval_rows'))} rows.{pairs}\n\n" + _table(("metric", "value"), rows)
        )
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------ the card


def _round_section(lineage: dict[str, Any] | None) -> list[str]:
    parent = (lineage or {}).get("parent_run")
    if not parent:
        return []
    what = "LoRA adapter" if parent["kind"] == "adapter" else "full weights"
    step = f" (step {parent['global_step']})" if parent.get("global_step") is not None else ""
    return [
        f"## Round {lineage['round']}",
        f"This run is round {lineage['round']} of training in rounds: it started from the trained policy of "
        f"round {parent['round']}, {_code(parent['path'])}{step}, its {what}, and trained against the same frozen "
        "reference (the weights hash below).",
    ]


def build_model_card(
    config: dict[str, Any],
    manifest: Manifest,
    history: list[dict[str, Any]],
    *,
    adapter: bool,
    model_path: str,
    model_name: str | None = None,
    chat_template: bool = True,
    num_processes: int | None = None,
    precision: str | None = None,
    versions: dict[str, str] | None = None,
    lineage: dict[str, Any] | None = None,
) -> str:
    """The card's text (YAML front matter + Markdown) for the model saved at `model_path`.

    config: `TrainConfig.to_dict()`; manifest: the training cache's manifest.json; history: the metrics records
    of the run (train records carry `loss`, evaluation records `eval_reward_accuracy`). `adapter`: the folder
    holds LoRA adapters (not a full model); a run with `lora_r` set and `adapter=False` is its merged model.
    `precision` is accelerate's mixed_precision ("no", "bf16", "fp16"); None reads the config's flags.
    `lineage`: for a run started with --init-from, its round and parent run (trainer_state's `round`, `parent_run`).
    """
    from huggingface_hub import ModelCardData

    manifest = Manifest(manifest)  # a manifest.json read as a plain dict works too
    lora = config.get("lora_r") is not None
    parent = (lineage or {}).get("parent_run")
    # the weights this run's LoRA adapters sit on: a full-weights parent's, else the reference (or --model)
    base = parent["path"] if parent and parent["kind"] == "full" else config.get("model") or manifest.reference_model
    dataset = manifest.dataset["name_or_path"]
    objective = objective_for(config["loss_type"])
    card = FAMILY_CARDS[objective.name]
    model_name = model_name or Path(config["output_dir"]).name
    steps = [r["step"] for r in history if "step" in r]
    data = ModelCardData(
        base_model=hub_base_model(base),
        datasets=[dataset] if is_hub_id(dataset) else None,
        # peft's own cards use library_name peft for adapter folders (the Hub then shows peft's loading code)
        library_name="peft" if adapter else "transformers",
        model_name=model_name,
        tags=[card.tag, "kto-pipeline", *(["lora", "peft"] if adapter else [])],
    )

    if adapter:
        what = f"This folder holds LoRA adapters (not a full model) for {_link(base)}"
    elif lora:
        what = f"This model is a fine-tuned version of {_link(base)} (LoRA adapters merged into its weights)"
    else:
        what = f"This model is a fine-tuned version of {_link(base)}"
    split = manifest.dataset.get("split")
    source = f"{_link(dataset, 'datasets/')}{f' (split {_code(split)})' if split else ''}"
    trained = card.sentence(config, what, source)
    intro = (
        f"{trained}\n"
        "It was trained with kto-pipeline's two-stage pipeline: `kto-pipeline precompute` scored the data once "
        f"with the frozen reference model {_link(manifest.reference_model)} into a cache of "
        "log-probabilities, and `kto-pipeline train` trained the policy alone against that cache."
    )

    load_notes = []
    if adapter:
        load_notes.append(
            f"The adapters load on top of their base model, which `adapter_config.json` names "
            f"({_code(base)}); it must be reachable under that name (edit `base_model_name_or_path` if it moved)."
        )
        if config.get("merge"):
            load_notes.append(
                f"The run also wrote the merged full model to {_code(str(Path(model_path) / 'merged'))}: load it "
                "with `AutoModelForCausalLM.from_pretrained`, no peft needed."
            )
    snippet = _loading_snippet(model_path, adapter, chat_template, bool(config.get("trust_remote_code")))
    versions = versions if versions is not None else framework_versions(peft=lora)

    sections = [
        f"# Model Card for {model_name}",
        intro,
        "## How to load it",
        f"```python\n{snippet}\n```",
        *load_notes,
        *_round_section(lineage),
        "## Training settings",
        _table(
            ("setting", "value"),
            _settings_rows(
                config, objective, manifest.max_length, max(steps) if steps else None, num_processes, precision
            ),
        ),
        "## The cache it trained on",
        "The reference log-probabilities every reward is measured against; the hashes identify the exact "
        "reference weights, tokenizer and data.",
        _table(("field", "value"), _cache_rows(config, manifest)),
        "## Results",
        _results(config, history),
        "### Framework versions",
        "\n".join(f"- {name}: {version}" for name, version in versions.items()),
        "## Citations",
        f"Cite {card.paper['short']} as:\n\n```bibtex\n{card.paper['citation']}\n```",
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


def write_model_card(
    directory: str | Path,
    config: dict[str, Any],
    manifest: Manifest,
    history: list[dict[str, Any]],
    *,
    adapter: bool,
    chat_template: bool = True,
    num_processes: int | None = None,
    precision: str | None = None,
    lineage: dict[str, Any] | None = None,
) -> Path:
    """Write DIRECTORY/README.md for the model saved in `directory` (replacing peft's placeholder card)."""
    directory = Path(directory)
    name = Path(config["output_dir"]).name
    merged = config.get("lora_r") is not None and not adapter
    text = build_model_card(
        config,
        manifest,
        history,
        adapter=adapter,
        model_path=str(directory.resolve()),
        model_name=f"{name}-merged" if merged else name,
        chat_template=chat_template,
        num_processes=num_processes,
        precision=precision,
        lineage=lineage,
    )
    path = directory / CARD_FILE
    path.write_text(text)
    return path
