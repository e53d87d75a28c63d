"""kto-pipeline vs trl.KTOTrainer (1.16) on a GPU: Qwen2-0.5B-sized model, bf16, speed, memory and MFU.

    python benchmarks/bench_gpu.py --device cuda --preset qwen2-0.5b   # one configuration in detail, RESULTS-gpu.md
    python benchmarks/bench_gpu.py --device cpu --preset tiny          # a minute-long check of every code path

Nothing is downloaded: Qwen2-0.5B's config with random weights, a character tokenizer padded to its vocabulary,
row lengths from the bundled HH-RLHF sample. Offline, carry the wheels (`pip download -d wheels pip setuptools wheel
torch==2.13.0 ".[dev,gguf]" liger-kernel` on the same platform and Python), then `PIP_NO_INDEX=1
PIP_FIND_LINKS=$PWD/wheels make bench-gpu`. Without the optional liger-kernel its column says why it was skipped.

Each case runs in a fresh subprocess (`bench_gpu.py worker NAME`), its peak memory its own: first the step-1 check,
then kto-pipeline's `precompute` and `train` (`--torch-compile` at its default, and flipped); trl online, with
`precompute_ref_log_probs=True`, and with `use_liger_kernel=True` too ("trl's best" in the goals: the fastest). All
train on the same rows, order, batch, max_length, optimizer and precision, gradient checkpointing off; each tool
pairs rows with its own KL completions.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import shlex
import statistics
import string
import sys
import time
from pathlib import Path

import harness
import torch
from harness import fresh_runs, median_step, peak_rss_mib, run_worker, step_timer, table, time_calls, utc_stamp

LEARNING_RATE = 1e-6
BETA = 0.1
OURS_PRECOMPUTE = dict(batch_size=64, max_tokens_per_batch=16384)
PEAK_FLOPS_CUDA = 989e12  # bf16 dense tensor-core peak of an H100 SXM (H200: the same)
GOALS = dict(step_speedup=1.5, memory_ratio=0.6, mfu=0.40)
OURS_CASES = ("ours_precompute", "ours_train", "ours_precompute_dense", "ours_train_dense")
# training with --torch-compile the other way from its default (unset: compiled on CUDA, eager on the CPU), on the
# default kernel's cache; compiled on a CPU it attends on the dense mask (see ours_worker)
FLIPPED = "ours_train_compile_flipped"
TRL_CASES = ("trl_online", "trl_precomputed", "trl_liger")
# the step-1 check, run first: (attention kernel asked, --torch-compile) with both stages in one regime (float32
# weights under bf16 autocast on CUDA), 64 rows, one step of 8; "auto" is the block mask on a GPU, by tree on a CPU
STEP_ONE = {
    "step_one_default": ("auto", False),
    "step_one_default_compiled": ("auto", True),
    "step_one_by_tree": ("by-tree", False),
    "step_one_dense": ("dense", False),
}
STEP_ONE_ROWS, STEP_ONE_BATCH = 64, 8
STEP_ONE_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins")


def step_one_keys(preset: dict) -> tuple[str, ...]:
    """The step-1 metrics the check reads: the rewards, then KTO's KL or a pair loss's accuracy (trl's: 0)."""
    return (*STEP_ONE_KEYS, "rewards/accuracies" if pairs(preset) else "kl")


LABELS = {
    "ours": "kto-pipeline",
    "trl_online": "trl online",
    "trl_precomputed": "trl precomputed",
    "trl_liger": "trl precomputed + liger",
}
ALPHABET = string.ascii_letters + string.digits + " "
PRECISION = dict(
    cuda="bf16: kto-pipeline's reference pass in bfloat16 weights, both trainers bf16 autocast over float32 weights",
    cpu="float32 everywhere (bf16 is slow on this CPU)",
)
MEMORY = dict(cuda="peak CUDA memory allocated, reset before each phase reported", cpu="peak RSS of the process")


def hh_rlhf_lengths() -> list[tuple[int, int]]:
    """(prompt, completion) token counts of the bundled HH-RLHF chosen and rejected answers (chat template, char
    tokenizer)."""
    from kto_pipeline.demo.hh_rlhf import bundled_path, convert_pair, read_pairs
    from kto_pipeline.demo.tiny import build_char_tokenizer

    tok = build_char_tokenizer()

    def count(messages, generation_prompt: bool = False) -> int:
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return len(tok(text)["input_ids"])

    out = []
    for line, row in read_pairs(bundled_path()):
        pair = convert_pair(row, line)
        prompt = count(pair["prompt"], generation_prompt=True)
        for key in ("chosen", "rejected"):
            out.append((prompt, count(pair["prompt"] + pair[key]) - prompt))
    return out


def build_data(path: Path, preset: dict) -> dict:
    """Unpaired rows of random characters (a token each; both tools append EOS), labels alternating, lengths drawn
    from HH-RLHF's scaled so that the sample's longest prompt + completion is max_length; for a pair loss, pairs
    (prompt, chosen, rejected) with one HH-RLHF pair's lengths each."""
    real, max_length = hh_rlhf_lengths(), preset["max_length"]
    totals = [p + c for p, c in real]
    scale = max_length / max(totals)
    rng = random.Random(0)
    lengths, rows = [], []

    def chars(n: int) -> str:
        return "".join(rng.choices(ALPHABET, k=n))

    for i in range(preset["rows"]):
        pair = rng.randrange(len(real) // 2)
        prompt = max(1, round(real[2 * pair][0] * scale))
        answers = [min(max(2, round(c * scale)), max_length - prompt) for _, c in real[2 * pair : 2 * pair + 2]]
        lengths += [prompt + a for a in (answers if pairs(preset) else answers[:1])]  # tokens, EOS included
        if pairs(preset):
            rows.append(dict(prompt=chars(prompt), chosen=chars(answers[0] - 1), rejected=chars(answers[1] - 1)))
        else:
            rows.append(dict(prompt=chars(prompt), completion=chars(answers[0] - 1), label=i % 2 == 0))
    harness.write_jsonl(path, rows)
    source = dict(source_pairs=len(real) // 2, source_mean=statistics.mean(totals), source_max=max(totals))
    return dict(source, scale=scale, mean=statistics.mean(lengths), median=statistics.median(lengths), max=max(lengths))


def pairs(preset: dict) -> bool:
    """Whether the run trains a pair loss (trl.DPOTrainer's), on pairs, against trl's DPOTrainer."""
    return preset["loss_type"] != "kto"


def trl_name(preset: dict) -> str:
    return f"trl.DPOTrainer, loss {preset['loss_type']}" if pairs(preset) else "trl.KTOTrainer"


def data_text(preset: dict) -> str:
    if pairs(preset):
        return f"{preset['rows']} pairs (prompt, chosen, rejected) of random characters (1 token each)"
    return f"{preset['rows']} unpaired rows of random characters (1 token each), labels alternating"


def peak_memory_mib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()


def reset_peak_memory(device: str) -> None:
    """CUDA: the next peak counts from what is allocated now (a CPU's peak RSS is the process', never reset)."""
    if device == "cuda":
        torch.cuda.init()  # the statistics exist once CUDA is initialised
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def row_lengths(rows, max_length: int, kl: str = "kl_completion_ids") -> list[list[int]]:
    """[P, C, K] per row of `rows`, completions truncated where prompt + completion pass max_length."""
    if hasattr(rows, "to_pydict"):  # a pyarrow table
        rows = rows.select(["prompt_ids", "completion_ids", kl]).to_pydict()
    out = []
    for p, c, k in zip(rows["prompt_ids"], rows["completion_ids"], rows[kl], strict=True):
        room = max_length - len(p)
        out.append([len(p), min(len(c), room), min(len(k), room)])
    return out


def pair_lengths(work: Path, n: int | None = None) -> list[list[int]]:
    """[P, C, R] of the first `n` pairs of the data (every pair: None): a token a character, EOS after an answer (no
    truncation: build_data keeps each prompt + answer within max_length)."""
    rows = [json.loads(line) for line in (work / "data.jsonl").read_text().splitlines()[:n]]
    return [[len(r["prompt"]), len(r["chosen"]) + 1, len(r["rejected"]) + 1] for r in rows]


def ours_worker(name: str, work: Path, preset: dict, device: str, out: Path) -> dict:
    """kto-pipeline's reference pass (its time from the manifest) or its training on ours_precompute's cache: times,
    row lengths, peak memory and the attention kernel that ran."""
    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.cache import open_cache

    asked, ml = "dense" if name.endswith("_dense") else "auto", preset["max_length"]
    if name == FLIPPED and device == "cpu":
        asked = "dense"  # by tree, attention's calls and shapes follow the trees: a graph each
    if "precompute" in name:
        reset_peak_memory(device)
        paths = dict(model=str(work / "model"), dataset=str(work / "data.jsonl"), output=str(out), overwrite=True)
        dtype = "bfloat16" if device == "cuda" else "float32"
        config = PrecomputeConfig(**paths, max_length=ml, dtype=dtype, attention_kernel=asked, **OURS_PRECOMPUTE)
        config = dataclasses.replace(config, static_shapes=preset["static_shapes"], pairs_only=pairs(preset))
        cache = open_cache(precompute(config))
        kernel = cache.manifest["reference_pass"].get("attention_kernel")
        lengths = pair_lengths(work) if pairs(preset) else row_lengths(cache.table, ml)
        seconds = cache.manifest.timing["reference_pass_seconds"]
        return dict(ref_seconds=seconds, ref_lengths=lengths, ref_peak_mib=peak_memory_mib(device), kernel=kernel)
    cache_dir = work / "runs" / "ours_precompute"
    rows = open_cache(cache_dir).table.slice(0, preset["steps"] * preset["batch"])
    reset_peak_memory(device)
    settings = dict(batch=preset["batch"], steps=preset["steps"], learning_rate=LEARNING_RATE, bf16=device == "cuda")
    settings |= dict(beta=BETA, attention_kernel=asked, torch_compile=(device != "cuda") if name == FLIPPED else None)
    settings |= dict(loss_type=preset["loss_type"], static_shapes=preset["static_shapes"])
    res = train(harness.ours_train_config(cache_dir, out, **settings))
    result = dict(step_seconds=res.step_seconds, train_peak_mib=peak_memory_mib(device))
    state = harness.trainer_state(out)
    result |= dict(kernel=state.get("attention_kernel"), compile=state.get("compile"))
    n_train = preset["steps"] * preset["batch"]
    return dict(result, train_lengths=pair_lengths(work, n_train) if pairs(preset) else row_lengths(rows, ml))


def trl_worker(name: str, work: Path, preset: dict, device: str, out: Path) -> dict:
    """trl_online / trl_precomputed / trl_liger: the reference pass where there is one, then the steps."""
    from trl import DPOTrainer, KTOTrainer

    ml, n_train = preset["max_length"], preset["steps"] * preset["batch"]
    sync = torch.cuda.synchronize if device == "cuda" else None  # a reading includes the device's queued work
    timing: dict = {}

    def on_pass(seconds: float, dataset, *args, **kwargs) -> None:
        lengths = pair_lengths(work) if pairs(preset) else row_lengths(dataset, ml, "KL_completion_ids")
        timing.update(ref_seconds=seconds, ref_lengths=lengths)

    time_calls(DPOTrainer if pairs(preset) else KTOTrainer, "_precompute_ref_logps", on_pass, synchronize=sync)
    reset_peak_memory(device)
    # float32 weights (the optimizer's master copy), bf16 autocast on CUDA: as kto-pipeline's train
    run = dict(batch=preset["batch"], max_length=ml, precompute=name != "trl_online", bf16=device == "cuda")
    run |= dict(beta=BETA, learning_rate=LEARNING_RATE, max_steps=preset["steps"], use_liger_kernel=name == "trl_liger")
    run |= dict(precompute_ref_batch_size=preset["batch"], train_sampling_strategy="sequential", **harness.TRL_RUN)
    if pairs(preset):
        run |= dict(pairs=True, loss_type=[preset["loss_type"]])
    trainer = harness.trl_trainer(work / "model", work / "data.jsonl", out, **run)
    result = dict(timing, ref_peak_mib=peak_memory_mib(device)) if timing else {}
    if pairs(preset):
        result["train_lengths"] = pair_lengths(work, n_train)
    else:
        result["train_lengths"] = row_lengths(trainer.train_dataset[:n_train], ml, "KL_completion_ids")
    timer = step_timer(synchronize=sync)
    trainer.add_callback(timer)
    reset_peak_memory(device)
    trainer.train()
    result.update(step_seconds=timer.times, train_peak_mib=peak_memory_mib(device))
    return result


def step_one_worker(name: str, work: Path, preset: dict, device: str, out: Path) -> dict:
    """Both stages on the first STEP_ONE_ROWS rows in one precision regime, then one training step: at step 1 the
    policy is the reference, so its rewards and KL are 0 where both stages compute each sequence alike."""
    from kto_pipeline import PrecomputeConfig, precompute, train

    asked, compiled = STEP_ONE[name]
    if compiled and device == "cpu":
        asked = "dense"  # as FLIPPED: by tree, attention's calls and shapes follow the trees, a graph each
    data = out / "data.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join((work / "data.jsonl").read_text().splitlines(keepends=True)[:STEP_ONE_ROWS]))
    bf16, ml = device == "cuda", preset["max_length"]
    common = dict(bf16=bf16, attention_kernel=asked, torch_compile=compiled, static_shapes=preset["static_shapes"])
    config = PrecomputeConfig(model=str(work / "model"), dataset=str(data), output=str(out / "cache"), max_length=ml)
    config = dataclasses.replace(config, overwrite=True, pairs_only=pairs(preset), **OURS_PRECOMPUTE, **common)
    cache = precompute(config)
    settings = dict(batch=STEP_ONE_BATCH, steps=1, learning_rate=LEARNING_RATE, beta=BETA, **common)
    settings["loss_type"] = preset["loss_type"]
    train(harness.ours_train_config(cache, out / "run", **settings))
    first = json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[0])
    manifest, state = json.loads((cache / "manifest.json").read_text()), harness.trainer_state(out / "run")
    kernels = f"{manifest['reference_pass'].get('attention_kernel')} / {state.get('attention_kernel')}"
    return dict(step_one={k: first[k] for k in step_one_keys(preset)}, kernel=kernels, precision=state.get("precision"))


WORKERS = dict.fromkeys((*OURS_CASES, FLIPPED), ours_worker) | dict.fromkeys(TRL_CASES, trl_worker)
WORKERS |= dict.fromkeys(STEP_ONE, step_one_worker)


def worker(name: str, work: Path, preset: dict, device: str, out: Path) -> dict:
    """One case (harness.measured without RSS: the cases read their own peaks)."""
    if name not in WORKERS:
        raise SystemExit(f"unknown worker {name}")

    def run() -> dict:
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device in the worker")
        cpu = f"{harness.cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
        device_name = torch.cuda.get_device_name(0) if device == "cuda" else cpu
        return {"device_name": device_name, **WORKERS[name](name, work, preset, device, out)}

    return harness.measured(run, rss=False)


def gpu_worker(name: str, work: Path, args, preset: dict, must_succeed: bool = True) -> dict:
    """`bench_gpu.py worker NAME` in a fresh process, offline, with its own datasets cache (no trl case may reuse
    another one's reference log-probs)."""
    env = {"TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "hf-datasets-cache" / name)}
    if args.device == "cpu":
        env |= {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}
    flags = ["--preset", args.preset, "--device", args.device, "--batch", str(preset["batch"])]
    flags += ["--steps", str(preset["steps"]), "--loss-type", preset["loss_type"]]
    flags += ["--static-shapes"] if preset["static_shapes"] else []
    return run_worker(Path(__file__), name, work, flags, env=env, must_succeed=must_succeed, width=18)


def liger_unavailable(device: str) -> str | None:
    if device != "cuda":
        return f"skipped: liger-kernel's Triton kernels need a CUDA GPU (device is {device})"
    if importlib.util.find_spec("liger_kernel") is None:
        return "skipped: liger-kernel is not installed (`pip install liger-kernel`)"
    return None


class Flops:
    """Model FLOPs of the tokens a step or a reference pass needs (see `formula`)."""

    def __init__(self, preset: dict):
        import torch
        from transformers import Qwen2ForCausalLM

        from kto_pipeline.demo.tiny import build_char_tokenizer

        with torch.device("meta"):
            model = Qwen2ForCausalLM(harness.qwen2_config(preset, build_char_tokenizer(64)))
        embedding = model.get_input_embeddings().weight.numel()
        # untied: the LM head is among the parameters; tied: it is the embedding, counted once more as a matmul
        all_params = sum(p.numel() for p in model.parameters())
        self.n_lm_head = preset["vocab"] * preset["hidden"]
        self.n_non_embedding = all_params - embedding - (0 if preset["tie_word_embeddings"] else self.n_lm_head)
        self.n = self.n_non_embedding + self.n_lm_head
        self.pairs = pairs(preset)
        self.layers, self.hidden = preset["layers"], preset["hidden"]

    def per_token(self, seq_len: int) -> float:
        return 2 * self.n + 2 * self.layers * seq_len * self.hidden

    def reference(self, rows) -> float:
        return sum((p + c) * self.per_token(p + c) + k * self.per_token(p + k) for p, c, k in rows)

    def train(self, rows) -> float:
        """Forward + backward of P + C; the KL completion's forward alone (a pair loss: the rejected answer's forward
        and backward too)."""
        k_passes = 3 if self.pairs else 1
        return sum(3 * (p + c) * self.per_token(p + c) + k_passes * k * self.per_token(p + k) for p, c, k in rows)

    def formula(self, peak: float | None) -> list[str]:
        if peak is None:
            peak_text = "none on CPU (MFU is reported as n/a)"
        elif peak == PEAK_FLOPS_CUDA:
            peak_text = f"{peak / 1e12:g}e12 FLOP/s, the bf16 dense tensor-core peak of an H100 SXM"
        else:
            peak_text = f"{peak / 1e12:g}e12 FLOP/s (--peak-tflops)"
        return [
            "- MFU = model FLOPs of the needed tokens / wall seconds / peak: train step, a step's FLOPs (the mean over "
            "steps 2..n) over the median step's time (the median of steps 2..n leaves out kto-pipeline's steps that "
            "compiled, trainer_state.json's compile.compiling_steps, where other steps are left); "
            f"reference pass, every row over its time; peak = {peak_text}.",
            *(
                [
                    "- per pair (P prompt, C chosen, K rejected answer): reference pass (P + C) f(P + C) + K f(P + K); "
                    "training step 3 (P + C) f(P + C) + 3 K f(P + K) (policy forward + backward of both), i.e. "
                    "6 N (P + C + K) plus attention."
                ]
                if self.pairs
                else [
                    "- per row (P prompt, C completion, K KL completion, each truncated at max_length): reference "
                    "pass (P + C) f(P + C) + K f(P + K); training step 3 (P + C) f(P + C) + K f(P + K) (policy "
                    "forward + backward of P + C, KL completion forward without grad), i.e. 6 N (P + C) + 2 N K plus "
                    "attention."
                ]
            ),
            f"- forward FLOPs of a token among L: f(L) = 2 N + 2 n_layers L d; N = {self.n / 1e6:.1f}M = "
            f"{self.n_non_embedding / 1e6:.1f}M non-embedding parameters + the LM head's {self.n_lm_head / 1e6:.1f}M "
            "(tied to the input embedding, but a vocab x hidden matmul per token); attention: QK^T and AV cost 4 d "
            f"per key, token and layer, over L/2 keys on average (causal); d = hidden = {self.hidden}, n_layers = "
            f"{self.layers}; not counted: the embedding lookup, norms, rotary, softmax, activations, the optimizer.",
        ]


def _column(res: dict, ref: dict, batch: int, flops: Flops | None, peak: float | None) -> dict:
    """One column: ref tokens/s and MFU, step seconds and MFU, peak memory (MFU None without a peak)."""
    if "skipped" in res or "failed" in res:
        return {"note": res.get("skipped") or f"failed: {res['failed']}"}
    compiling = harness.compiling_steps(res)  # left out of the median where other steps are left
    c: dict = {"step_seconds": res["step_seconds"], "step": median_step(res["step_seconds"], compiling)}
    timed_rows = res["train_lengths"][batch:] if len(res["step_seconds"]) > 1 else res["train_lengths"]
    timed_steps = max(len(res["step_seconds"]) - 1, 1)  # a step's FLOPs (their mean) over the median step's time
    c["step_mfu"] = flops.train(timed_rows) / timed_steps / c["step"] / peak if peak else None
    c["train_peak_mib"] = res["train_peak_mib"]
    if "ref_seconds" in ref:
        rows, seconds = ref["ref_lengths"], ref["ref_seconds"]
        tokens = sum(sum(row) for row in rows)  # needed tokens: P + C + K, each prompt once
        c |= dict(ref_tokens_per_s=tokens / seconds, ref_peak_mib=ref["ref_peak_mib"])
        c["ref_mfu"] = flops.reference(rows) / seconds / peak if peak else None
    return c


def _liger_version() -> str:
    """The versions line's liger-kernel part: ", liger-kernel X.Y", or "" where it is not installed."""
    try:
        return f", liger-kernel {importlib.metadata.version('liger-kernel')}"
    except importlib.metadata.PackageNotFoundError:
        return ""


def command_line(argv: list[str]) -> str:
    """The command as run, from the repository root, the paths it was given (--work, --results) left out."""
    shown, skip = [], False
    for arg in argv:
        if not skip and arg.split("=")[0] not in ("--work", "--results"):
            shown.append(shlex.quote(arg))
        skip = arg in ("--work", "--results")
    return " ".join(["python", "benchmarks/bench_gpu.py", *shown])


def measurements(steps: int) -> list[tuple[str, str, str]]:
    """The main table's rows: (label, key of the column's summary, format)."""
    return [
        ("reference pass, needed tokens/s", "ref_tokens_per_s", ".0f"),
        ("reference pass, MFU %", "ref_mfu", ".1f"),
        ("reference pass, peak memory (MiB)", "ref_peak_mib", ".0f"),
        (f"train step (s), median of steps 2..{steps}", "step", ".4f"),
        ("train step, MFU %", "step_mfu", ".1f"),
        ("train, peak memory (MiB)", "train_peak_mib", ".0f"),
    ]


def provenance(args, r: dict, preset: dict, flops: Flops, seconds: float, stamp: str) -> list[str]:
    """A report's first lines: command, date, device, versions, model."""
    name = next((v["device_name"] for v in r.values() if "device_name" in v), "unknown")
    return [
        f"- command: `{command_line(args.argv)}`",
        f"- date: {stamp}; total benchmark time {seconds:.0f} s",
        f"- device: {name} ({args.device}); {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}",
        f"- versions: {harness.versions('kto-pipeline', 'torch', 'transformers', 'trl')}{_liger_version()}",
        f"- model: Qwen2 with random weights, hidden {preset['hidden']}, {preset['layers']} layers, "
        f"{preset['heads']} heads ({preset['kv_heads']} KV), intermediate {preset['intermediate']}, vocab "
        f"{preset['vocab']}, tied embeddings {preset['tie_word_embeddings']}, rope_theta {preset['rope_theta']:g}: "
        f"{flops.n_non_embedding / 1e6:.1f}M non-embedding parameters",
    ]


def render(cols: dict, r: dict, preset: dict, data: dict, flops: Flops, args, peak: float | None, seconds) -> str:
    cuda = args.device == "cuda"

    def cell(col: str, key: str, fmt: str) -> str:
        c = cols[col]
        if "note" in c:
            return c["note"] if key == "step" else "-"
        if key not in c:
            return "-"
        value = c[key]
        if value is None:
            return "n/a"
        return format(value * 100 if key.endswith("mfu") else value, fmt)

    stamp = utc_stamp()
    rows = ((label, *(cell(c, k, f) for c in LABELS)) for label, k, f in measurements(preset["steps"]))
    lines = [
        f"# GPU benchmark: kto-pipeline vs {trl_name(preset)} ({args.preset})",
        "",
        *provenance(args, r, preset, flops, seconds, stamp),
        f"- data: {data_text(preset)}; lengths "
        f"from the {data['source_pairs']} bundled HH-RLHF pairs' chosen and rejected answers (chat template, mean "
        f"{data['source_mean']:.0f} / max {data['source_max']} tokens) scaled by {data['scale']:.3f} to max_length "
        f"{preset['max_length']}: prompt + completion mean {data['mean']:.0f}, median {data['median']:.0f}, max "
        f"{data['max']} tokens",
        f"- settings, all cases: {PRECISION[args.device]}; gradient checkpointing off; batch {preset['batch']} x 1 "
        f"process, the same rows in sequential order, {preset['steps']} steps, AdamW lr {LEARNING_RATE}, beta {BETA}; "
        f"reference pass batches: kto-pipeline's batch_size {OURS_PRECOMPUTE['batch_size']}, max_tokens_per_batch "
        f"{OURS_PRECOMPUTE['max_tokens_per_batch']}; trl's precompute_ref_batch_size {preset['batch']} (its default)"
        + ("; kto-pipeline with --static-shapes" if preset["static_shapes"] else ""),
        f"- memory: {MEMORY[args.device]}",
        "",
        *table(harness.md_row("measurement", *LABELS.values()), rows),
        "",
        "trl online's reference model runs inside every training step (no reference pass). Needed tokens count each "
        "prompt once (P + C + K a row), for every tool alike.",
        *step_one_table(r, preset, stamp, cuda),
        *kernels_table(r, preset, stamp),
        *compiled_table(r, preset, stamp),
        *goals(cols, cuda, stamp),
        *["", "## Formula", "", *flops.formula(peak)],
    ]
    raw = [f"{LABELS[c]} {[round(x, 4) for x in cols[c]['step_seconds']]}" for c in LABELS if "step_seconds" in cols[c]]
    return "\n".join([*lines, "", f"- raw step times (s): {'; '.join(raw)}", ""])


def kernels_table(r: dict, preset: dict, stamp: str) -> list[str]:
    """kto-pipeline under its default attention kernel against the dense mask, on the same steps."""
    cases = [(r["ours_train" + kind], r["ours_precompute" + kind]) for kind in ("", "_dense")]
    kernels = [f"{ref['kernel']} / {res['kernel']}" for res, ref in cases]
    default, dense = (_column(res, ref, preset["batch"], None, None) for res, ref in cases)
    rows = [("kernel that ran (reference pass / train)", *kernels, "")]
    for label, key, fmt in measurements(preset["steps"]):
        if not key.endswith("mfu"):
            a, b = default[key], dense[key]
            ratio = a / b if label.endswith("tokens/s") else b / a  # dense / default: > 1 favours the default
            rows.append((label, format(a, fmt), format(b, fmt), f"{ratio:.2f}x"))
    header = "| measurement | kto-pipeline, default kernel | kto-pipeline, dense mask | dense / default |"
    return [
        "",
        "## Attention kernel: block mask vs dense mask (kto-pipeline)",
        "",
        f"- date: {stamp} (the run above)",
        "",
        *table(header, rows),
        "",
        "`x` > 1 favours the default kernel. On a CPU the default is attention by tree (FlexAttention has no backward "
        "there): by-tree against the dense mask.",
        "",
    ]


def compiled_table(r: dict, preset: dict, stamp: str) -> list[str]:
    """kto-pipeline's training with --torch-compile against without, on the same cache and steps."""
    lines = ["", "## `--torch-compile` (kto-pipeline's training)", "", f"- date: {stamp} (the run above)", ""]
    if "failed" in r[FLIPPED]:
        return [*lines, f"- the run with --torch-compile flipped from its default failed: {r[FLIPPED]['failed']}", ""]
    eager, compiled = sorted((r["ours_train"], r[FLIPPED]), key=lambda res: bool(res.get("compile")))
    default = "--torch-compile" if compiled is r["ours_train"] else "eager"
    a, b = (_column(res, r["ours_precompute"], preset["batch"], None, None) for res in (eager, compiled))
    c = compiled["compile"]
    rows = [("kernel that ran", eager["kernel"], compiled["kernel"], "")]
    rows.append((f"train step (s), median of steps 2..{preset['steps']}", f"{a['step']:.4f}", f"{b['step']:.4f}"))
    rows[-1] += (f"{a['step'] / b['step']:.2f}x",)
    rows.append(("train, peak memory (MiB)", f"{a['train_peak_mib']:.0f}", f"{b['train_peak_mib']:.0f}", ""))
    rows.append(
        (
            "first step (s), compiling included",
            f"{eager['step_seconds'][0]:.2f}",
            f"{compiled['step_seconds'][0]:.2f}",
            "",
        )
    )
    compile_text = (
        f"{c['graphs']} graphs, {c['graph_breaks']} graph breaks, {c['recompiles']} recompiles, {c['seconds']:.1f} s"
    )
    rows.append(("compile (trainer_state.json)", "-", compile_text, ""))
    header = "| measurement | eager | --torch-compile | eager / compiled |"
    note = (
        f"The default (the main table's kto-pipeline column) is {default} here. On a CPU the compiled run attends on "
        "the dense mask (by tree, attention's calls follow the trees)."
    )
    return [*lines, *table(header, rows), "", note, ""]


def step_one_table(r: dict, preset: dict, stamp: str, cuda: bool) -> list[str]:
    """The step-1 check: every reward and the KL at step 1, by kernel and compile, "exact" where all are 0."""
    regime = "float32 weights under bf16 autocast" if cuda else "float32"
    rows = []
    for name, (asked, compiled) in STEP_ONE.items():
        if name not in r:
            continue
        res, label = r[name], f"{asked}{', --torch-compile' if compiled else ''}"
        if "failed" in res:
            rows.append((label, "-", *(["-"] * len(step_one_keys(preset))), f"failed: {res['failed']}"))
            continue
        values = [res["step_one"][k] for k in step_one_keys(preset)]
        exact = "yes" if all(v == 0 for v in values) else "NO"
        rows.append((label, res["kernel"], *(f"{v:.3g}" for v in values), exact))
    header = harness.md_row("--attention-kernel", "kernel that ran (precompute / train)", *step_one_keys(preset))
    header += " exactly 0 |"
    rows_used = min(STEP_ONE_ROWS, preset["rows"])
    return [
        "",
        "## Step 1 is the reference: the check run first",
        "",
        f"- date: {stamp}; both stages in one regime ({regime}), the first {rows_used} rows, one step of "
        f"{STEP_ONE_BATCH} {'pairs' if pairs(preset) else 'rows'} ({preset['loss_type']}), the model and data above",
        "",
        *table(header, rows),
        "",
    ]


def goals(cols: dict, cuda: bool, stamp: str) -> list[str]:
    ours, speedup, memory, mfu = cols["ours"], GOALS["step_speedup"], GOALS["memory_ratio"], GOALS["mfu"]
    trl_steps = {c: cols[c]["step"] for c in TRL_CASES if "step" in cols[c]}
    goal = f"train step >= {speedup}x faster than trl's best setting"
    rows = [(goal, "no trl case ran", "-")]
    if trl_steps:
        best = min(trl_steps, key=trl_steps.get)
        ratio = trl_steps[best] / ours["step"]
        rows = [(f"{goal} ({LABELS[best]})", f"{ratio:.2f}x", ratio >= speedup)]
    goal, online = f"train peak memory <= {memory}x trl online's", cols["trl_online"].get("train_peak_mib")
    ratio = ours["train_peak_mib"] / online if online else None
    rows.append((goal, f"{ratio:.2f}x", ratio <= memory) if online else (goal, "trl online did not run", "-"))
    goal, step_mfu = f"train step MFU >= {mfu:.0%}", ours.get("step_mfu")
    no_mfu = (goal, f"n/a on {'this device' if cuda else 'CPU'}", "-")
    rows.append(no_mfu if step_mfu is None else (goal, f"{step_mfu:.1%}", step_mfu >= mfu))
    lines = ["## Against the goals", "", f"- date: {stamp} (the run above)", "", *harness.goals_table(*rows)]
    if not cuda:
        lines += ["", "On CPU the goals are not meaningful (they are set for an H100); the table checks the code path."]
    return lines


def main() -> None:
    parser = harness.script_parser(
        __doc__,
        work=None,
        work_help="scratch directory (default: benchmarks/.work/gpu-PRESET)",
        results="Markdown file to write (default: RESULTS-gpu.md for qwen2-0.5b on cuda)",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", default="qwen2-0.5b", choices=sorted(harness.GPU_PRESETS))
    parser.add_argument("--batch", type=int, default=None, help="rows per step, every case (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None, help="training steps, every case (default: the preset's)")
    loss_help = "kto (against trl.KTOTrainer, unpaired rows) or a pair loss (against trl.DPOTrainer, pairs)"
    parser.add_argument("--loss-type", default="kto", choices=["kto", "sigmoid"], help=loss_help)
    static_help = "kto-pipeline's cases with --static-shapes (both stages)"
    parser.add_argument("--static-shapes", action="store_true", help=static_help)
    check_help = "only the step-1 check (every kernel, eager and compiled), written to --results alone"
    parser.add_argument("--check-only", action="store_true", help=check_help)
    peak_help = "The device's peak for MFU (bf16 dense)"
    parser.add_argument("--peak-tflops", type=float, default=PEAK_FLOPS_CUDA / 1e12, help=peak_help)
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    preset = dict(harness.GPU_PRESETS[args.preset], loss_type=args.loss_type, static_shapes=args.static_shapes)
    preset.update({key: getattr(args, key) for key in ("batch", "steps") if getattr(args, key) is not None})
    preset["rows"] = max(preset["rows"], preset["batch"] * preset["steps"])
    work = Path(args.work or harness.WORK_DIR / f"gpu-{args.preset}{'' if args.loss_type == 'kto' else '-pairs'}")
    if args.mode == "worker":
        harness.print_result(worker(args.name, work, preset, args.device, Path(args.out)))
        return

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch (use --device cpu --preset tiny)")
    started = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    print(f"building the model and data in {work} ...", flush=True)
    harness.random_qwen2(work / "model", preset)
    data = build_data(work / "data.jsonl", preset)
    fresh_runs(work)  # measure from scratch: no case may reuse a cache from an earlier run
    # the default path's check first (on a GPU eager and compiled, on a CPU its default, eager); --check-only: all
    default_path = ("step_one_default", "step_one_default_compiled") if args.device == "cuda" else ("step_one_default",)
    checks = STEP_ONE if args.check_only else default_path
    r = {name: gpu_worker(name, work, args, preset, must_succeed=False) for name in checks}
    if args.check_only:
        stamp, seconds = utc_stamp(), time.perf_counter() - started
        head = [f"# GPU step-1 check ({args.preset})", "", *provenance(args, r, preset, Flops(preset), seconds, stamp)]
        harness.publish("\n".join([*head, *step_one_table(r, preset, stamp, args.device == "cuda")]), args.results)
        return
    r |= {name: gpu_worker(name, work, args, preset) for name in OURS_CASES}
    r[FLIPPED] = gpu_worker(FLIPPED, work, args, preset, must_succeed=False)
    for name in TRL_CASES:
        skip = liger_unavailable(args.device) if name == "trl_liger" else None
        if skip:
            print(f"  {name:<18} {skip}", flush=True)
        r[name] = {"skipped": skip} if skip else gpu_worker(name, work, args, preset, must_succeed=False)
    flops = Flops(preset)
    peak = args.peak_tflops * 1e12 if args.device == "cuda" else None
    # a column per LABELS: its train case and its reference pass' (trl online records none)
    cases = {"ours": ("ours_train", "ours_precompute")} | {name: (name, name) for name in TRL_CASES}
    cols = {col: _column(r[t], r[ref], preset["batch"], flops, peak) for col, (t, ref) in cases.items()}
    report = render(cols, r, preset, data, flops, args, peak, time.perf_counter() - started)
    default = args.device == "cuda" and args.preset == "qwen2-0.5b" and args.loss_type == "kto"
    default = default and not args.static_shapes
    harness.publish_run(report, harness.default_results(args.results, default, "RESULTS-gpu.md"))


if __name__ == "__main__":
    main()
