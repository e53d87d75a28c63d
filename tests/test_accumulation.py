"""Gradient accumulation across processes: the micro-steps before an optimizer step exchange no gradients (DDP's
`no_sync`, FSDP2's `set_requires_gradient_sync`), so the gradient collectives per optimizer step are those of a run
without accumulation, and the run equals one process accumulating the same micro-batches."""

import json
from pathlib import Path

import pytest
from helpers import cli_args, launch, read_metrics, train_config

from kto_pipeline import train

COUNTER = Path(__file__).resolve().parent / "count_collectives.py"
FSDP_ENV = dict(ACCELERATE_USE_CPU="1", ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
# the gradient exchange: DDP all-reduces its buckets, FSDP2 reduce-scatters each sharded group
ENGINES = {"ddp": ({}, "allreduce_"), "fsdp2": (FSDP_ENV, "_reduce_scatter_base_")}
STEPS = 2
RUN = dict(max_steps=STEPS, logging_steps=1, learning_rate=1e-3, seed=3, train_sampling_strategy="sequential")


def _counted_run(tmp_path: Path, name: str, cache, env: dict, accumulation: int) -> dict[str, int]:
    args = cli_args(
        cache=cache, output_dir=tmp_path / name, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation
    )
    counts = tmp_path / f"counts-{name}"
    launch(2, counts, "train", *args, *cli_args(**RUN), env=env, log_dir=tmp_path / f"logs-{name}", script=COUNTER)
    per_rank = [json.loads(p.read_text()) for p in sorted(counts.glob("rank-*.json"))]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1], per_rank
    return per_rank[0]


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_micro_steps_exchange_no_gradients_and_match_one_process(tmp_path, small_cache, engine):
    env, gradient_op = ENGINES[engine]
    plain = _counted_run(tmp_path, "plain", small_cache, env, accumulation=1)
    accumulated = _counted_run(tmp_path, "accumulated", small_cache, env, accumulation=2)
    print(f"{engine}: collectives of {STEPS} optimizer steps, without / with 2 micro-steps each:", plain, accumulated)
    # the same gradient exchanges per optimizer step with 2 micro-steps as with 1 (without skipping: twice as many)
    assert plain[gradient_op] >= STEPS and accumulated[gradient_op] == plain[gradient_op], (plain, accumulated)
    # and the numbers of one process accumulating the same micro-batches (2 x 2 rows a micro-step)
    train(
        train_config(small_cache, tmp_path / "one", per_device_train_batch_size=4, gradient_accumulation_steps=2, **RUN)
    )
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "accumulated")
    assert len(one) == len(two) == STEPS
    for a, b in zip(two, one, strict=True):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
