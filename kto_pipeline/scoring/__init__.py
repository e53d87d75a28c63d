"""The scoring engine both stages share: packed layouts of (prompt, [completion, KL completion]) trees
(`packing.py`), the attention that runs them (`attention.py`: the masks and the kernel, run by `by_tree.py` or
`block_mask.py`), which models can take them (`packable.py`), per-token log-probs of the layouts and of padded
batches (`logprobs.py`) and the LM head they go through, in chunks (`head.py`); what a stage decides once about its
loaded model, and the scorers obey, is its `plan.py`."""

# what `--attention-kernel` takes (both stages): how packed rows attend, `attention.choose_kernel`. Here,
# beside the engine, so that the command line reads the names without loading it.
ATTENTION_KERNELS = ("auto", "by-tree", "block-mask", "dense")
ATTENTION_KERNEL_HELP = (
    "How packed rows attend: by-tree (sequence by sequence, sdpa or eager), block-mask (torch's FlexAttention under a "
    "block mask: only the (query, key) tiles each row's trees need), dense (sdpa or eager attention under the whole "
    "row's mask). auto: by-tree on the CPU, block-mask on accelerators; a kernel the model or device cannot take "
    "falls back, and the run says why."
)
