"""`kto-pipeline generate`'s settings: samples of a trained policy, or the completions of a round to label."""

from __future__ import annotations

from dataclasses import dataclass, field

from kto_pipeline.config.fields import (
    DECODING,
    DTYPES,
    MODELS,
    OUTPUT,
    PROMPTS,
    ROUNDS,
    ConfigMixin,
    check,
    described,
)


@dataclass
class GenerateConfig(ConfigMixin):
    """Side by side: the reference model's and the trained policy's answers to the same prompts. With
    `num_return_sequences`: that many sampled completions per prompt of a file, by the policy alone, written as
    dataset rows to label."""

    run: str = field(
        **described(
            "A `kto-pipeline train --output-dir` (full model or LoRA adapter): the policy and its tokenizer are "
            "loaded from it.",
            panel=MODELS,
        )
    )
    reference: str | None = field(
        default=None,
        **described(
            "Reference model (hub id or directory). Default: the reference model of the cache the run trained on.",
            panel=MODELS,
        ),
    )
    cache: str | None = field(
        default=None,
        **described(
            "A precompute cache whose prompts to answer (its token ids, chat template included), with its labelled "
            "completions shown alongside. Default: the run's --eval-cache.",
            panel=PROMPTS,
        ),
    )
    prompts: str | None = field(
        default=None,
        **described(
            "Instead of a cache: a .jsonl file whose rows have `prompt`, a string or a list of {role, content} "
            "messages (rendered with the chat template and the generation prompt).",
            panel=PROMPTS,
        ),
    )
    num_prompts: int | None = field(
        default=None,
        **described(
            "How many prompts to answer: the first ones, in order. Default: 8 distinct prompts side by side; "
            "with --num-return-sequences, every row of --prompts.",
            panel=PROMPTS,
        ),
    )
    max_new_tokens: int = field(
        default=128, **described("Most tokens of each answer (answers stop earlier at EOS).", panel=DECODING)
    )
    do_sample: bool | None = field(
        default=None,
        **described(
            "Sample the answers; without it decoding is greedy (the most likely token each step). Default: greedy "
            "side by side, sampled with --num-return-sequences.",
            panel=DECODING,
        ),
    )
    temperature: float = field(default=1.0, **described("Sampling temperature (when sampling).", panel=DECODING))
    top_p: float = field(
        default=1.0,
        **described("Nucleus sampling: sample among the most likely tokens of this total probability.", panel=DECODING),
    )
    seed: int = field(
        default=0,
        **described(
            "Seed of the sampling: the same seed, prompts and --batch-size give the same answers.", panel=DECODING
        ),
    )
    batch_size: int = field(
        default=8,
        **described(
            "Sequences per generate call (left-padded): prompts, or with --num-return-sequences, completions.",
            panel=DECODING,
        ),
    )
    num_return_sequences: int | None = field(
        default=None,
        **described(
            "Rounds: sample this many completions of each --prompts row with the policy alone (no reference) and "
            "write them as prompt/completion rows, unlabeled (label null) unless --label-with labels them, for "
            "`precompute --append`. Sampling is on; greedy is refused when it is above 1.",
            panel=ROUNDS,
        ),
    )
    label_with: str | None = field(
        default=None,
        **described(
            "With --num-return-sequences: label each row with your Python function, MODULE:FUNCTION (MODULE a "
            "dotted module name importable from the current directory, or a path to a .py file). It is called "
            "as FUNCTION(row) with the row dict (prompt, completion, policy, sample_index, ...) and must return "
            "True (desirable) or False (undesirable): a bool or numpy bool, nothing else.",
            panel=ROUNDS,
        ),
    )
    output: str | None = field(
        default=None,
        **described(
            "The file to write (JSON lines). Default: RUN/samples.jsonl, which `report` shows; with "
            "--num-return-sequences, RUN/rounds/completions.jsonl.",
            panel=OUTPUT,
        ),
    )
    overwrite: bool = field(
        default=False,
        **described(
            "With --num-return-sequences: replace an existing --output (else refused). The side-by-side samples "
            "file is always replaced.",
            panel=OUTPUT,
        ),
    )
    dtype: str = field(
        default="auto",
        **described("Dtype of both models: auto = bfloat16 on a GPU that supports it, else float32.", panel=MODELS),
    )
    trust_remote_code: bool = field(
        default=False, **described("Allow models and tokenizers that run their own code.", panel=MODELS)
    )

    @property
    def rounds(self) -> bool:
        """Sampled completions of a prompts file, written as rows to label (--num-return-sequences)."""
        return self.num_return_sequences is not None

    @property
    def sampling(self) -> bool:
        """Whether decoding samples: --do-sample / --no-do-sample, else on in rounds and off side by side."""
        return self.do_sample if self.do_sample is not None else self.rounds

    def __post_init__(self) -> None:
        check(
            self.cache is None or self.prompts is None,
            "prompts",
            "choose one prompt source: --cache (a precompute cache) or --prompts (a .jsonl file), not both",
        )
        check(
            self.num_prompts is None or self.num_prompts >= 1,
            "num_prompts",
            f"must be at least 1, got {self.num_prompts}",
        )
        check(self.max_new_tokens >= 1, "max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        check(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        for name in ("temperature", "top_p"):
            check(
                self.sampling or getattr(self, name) == 1.0,
                name,
                "only applies with --do-sample (greedy decoding ignores it)",
            )
        check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        n = self.num_return_sequences
        if n is None:
            for name in ("label_with", "overwrite"):
                check(not getattr(self, name), name, "only applies with --num-return-sequences")
            return
        check(n >= 1, "num_return_sequences", f"must be at least 1, got {n}")
        check(
            self.prompts is not None,
            "num_return_sequences",
            "samples completions of the rows of a prompts file, written with each row's prompt as given: pass "
            "--prompts FILE.jsonl" + (" instead of --cache" if self.cache is not None else ""),
        )
        check(
            self.reference is None,
            "reference",
            "does not apply with --num-return-sequences: completions are sampled with the policy (--run) alone",
        )
        check(
            self.sampling or n == 1,
            "num_return_sequences",
            f"{n} greedy completions of a prompt are one completion {n} times: drop --no-do-sample (completions "
            "are sampled by default) or ask for --num-return-sequences 1",
        )
        if self.label_with is not None:
            module, _, function = self.label_with.rpartition(":")
            check(
                bool(module.strip()) and function.strip().isidentifier(),
                "label_with",
                f"expected MODULE:FUNCTION (e.g. rules.py:label or my_package.rules:label), got {self.label_with!r}",
            )
