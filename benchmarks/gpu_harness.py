"""What the GPU benchmarks (`bench_gpu_matrix.py`, `step_one_layouts.py`, `flops_recompute.py`) share besides
harness.py: their data, the lengths they count, the memory they read and the model FLOPs their MFU divides. Nothing is
downloaded: a preset's Qwen2 with random weights, a character tokenizer, rows of random characters with the lengths of
the bundled HH-RLHF sample. (RESULTS-gpu.md's older reports are `benchmarks/bench_gpu.py`'s, in git at b791089.)
"""

from __future__ import annotations

import functools
import gc
import json
import random
import statistics
import string
from pathlib import Path

import harness
import torch

LEARNING_RATE = 1e-6
BETA = 0.1
PEAK_FLOPS_CUDA = 989e12  # bf16 dense tensor-core peak of an H100 SXM (H200: the same)
ALPHABET = string.ascii_letters + string.digits + " "


@functools.cache
def hh_rlhf_lengths() -> list[tuple[int, int]]:
    """(prompt, completion) token counts of the bundled HH-RLHF chosen and rejected answers (chat template)."""
    from kto_pipeline.demo.hh_rlhf import bundled_path, convert_pair, read_pairs
    from kto_pipeline.demo.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    texts = []  # per pair: the prompt, the prompt + chosen, the prompt + rejected
    for line, row in read_pairs(bundled_path()):
        pair = convert_pair(row, line)
        texts.append(tok.apply_chat_template(pair["prompt"], add_generation_prompt=True, tokenize=False))
        texts += [tok.apply_chat_template(pair["prompt"] + pair[k], tokenize=False) for k in ("chosen", "rejected")]
    counts = [len(ids) for ids in tok(texts)["input_ids"]]
    return [(p, whole - p) for p, *answers in zip(*[iter(counts)] * 3, strict=True) for whole in answers]


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
    """Whether the run trains a pair loss, on pairs, against trl's DPOTrainer."""
    return preset["loss_type"] != "kto"


def peak_memory_mib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else harness.peak_rss_mib()


def reset_peak_memory(device: str) -> None:
    """Free what earlier work left; CUDA: the next peak counts from what is allocated now (a CPU's is never reset)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.init()  # the statistics exist once CUDA is initialised
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def row_lengths(rows, max_length: int, kl: str = "kl_completion_ids") -> list[list[int]]:
    """[P, C, K] per row of `rows`, completions truncated where prompt + completion pass max_length."""
    if hasattr(rows, "to_pydict"):  # a pyarrow table
        rows = rows.select(["prompt_ids", "completion_ids", kl]).to_pydict()
    columns = zip(rows["prompt_ids"], rows["completion_ids"], rows[kl], strict=True)
    return [[len(p), min(len(c), max_length - len(p)), min(len(k), max_length - len(p))] for p, c, k in columns]


def pair_lengths(work: Path, n: int | None = None) -> list[list[int]]:
    """[P, C, R] of the first `n` pairs of the data (None: every pair): a token a character, EOS after an answer."""
    rows = [json.loads(line) for line in (work / "data.jsonl").read_text().splitlines()[:n]]
    return [[len(r["prompt"]), len(r["chosen"]) + 1, len(r["rejected"]) + 1] for r in rows]


class Flops:
    """Model FLOPs of the tokens a step or a reference pass needs (see `formula`)."""

    def __init__(self, preset: dict):
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
        self.pairs, self.layers, self.hidden = pairs(preset), preset["layers"], preset["hidden"]

    def per_token(self, seq_len: int) -> float:
        return 2 * self.n + 2 * self.layers * seq_len * self.hidden

    def reference(self, rows) -> float:
        return sum((p + c) * self.per_token(p + c) + k * self.per_token(p + k) for p, c, k in rows)

    def train(self, rows) -> float:
        """Forward + backward of P + C; the KL completion's forward alone (a pair loss: the rejected answer's forward
        and backward too)."""
        k_passes = 3 if self.pairs else 1
        return sum(3 * (p + c) * self.per_token(p + c) + k_passes * k * self.per_token(p + k) for p, c, k in rows)


def formula(models: dict[str, Flops], peak: float | None) -> list[str]:
    """How MFU is counted, with each model's N (`models`: name -> its Flops); `peak`: FLOP/s, None on a CPU."""
    if peak is None:
        peak_text = "none on CPU (MFU is reported as n/a)"
    elif peak == PEAK_FLOPS_CUDA:
        peak_text = f"{peak / 1e12:g}e12 FLOP/s, the bf16 dense tensor-core peak of an H100 SXM"
    else:
        peak_text = f"{peak / 1e12:g}e12 FLOP/s (--peak-tflops)"
    lines = [
        "- MFU = model FLOPs of the needed tokens / wall seconds / peak: train step, a step's FLOPs (the mean over "
        "steps 2..n) over the median step's time (the median of steps 2..n leaves out kto-pipeline's steps that "
        "compiled, trainer_state.json's compile.compiling_steps, where other steps are left); reference pass, every "
        f"row over its time; peak = {peak_text}.",
        "- per row (KTO; P prompt, C completion, K KL completion, each truncated at max_length): reference pass "
        "(P + C) f(P + C) + K f(P + K); training step 3 (P + C) f(P + C) + K f(P + K) (policy forward + backward of "
        "P + C, KL completion forward without grad), i.e. 6 N (P + C) + 2 N K plus attention.",
        "- per pair (a pair loss; P prompt, C chosen, K rejected answer): reference pass (P + C) f(P + C) + "
        "K f(P + K); training step 3 (P + C) f(P + C) + 3 K f(P + K) (policy forward + backward of both), i.e. "
        "6 N (P + C + K) plus attention.",
        "- forward FLOPs of a token among L: f(L) = 2 N + 2 n_layers L d; N = the non-embedding parameters + the LM "
        "head's (tied to the input embedding, but a vocab x hidden matmul per token); attention: QK^T and AV cost 4 d "
        "per key, token and layer, over L/2 keys on average (causal); d = hidden; not counted: the embedding lookup, "
        "norms, rotary, softmax, activations, the optimizer.",
    ]
    for name, f in models.items():
        lines.append(
            f"- {name}: N = {f.n / 1e6:.1f}M = {f.n_non_embedding / 1e6:.1f}M non-embedding parameters + the LM "
            f"head's {f.n_lm_head / 1e6:.1f}M; d = {f.hidden}, n_layers = {f.layers}"
        )
    return lines
