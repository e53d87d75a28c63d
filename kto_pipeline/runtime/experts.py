"""Mixture-of-experts layers whose every token computes alike, however many tokens its expert gets in a forward.

transformers' experts (`use_experts_implementation`: Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3, Qwen3-Next) run each
expert's product on the tokens routed to it: a matrix of as many rows as that expert got. A float32 product computes a
row otherwise when the matrix has few rows (on an AVX2 CPU, fewer than 4 rows: a row's outputs 3.8e-6 apart from the
same row among more), and a token's expert gets other counts in the reference pass (prompt, completion and KL
completion in one forward) than in training (the KL completions on the prompts' cached keys/values): step 1's KL
came 1.9e-6 from 0 on gpt-oss. Here each expert's products run in blocks of `ROWS` rows (zero rows fill the last),
one batched product of identical blocks, so that a token's outputs do not depend on the others: both stages compute
it alike. Registered as an experts implementation (`IMPLEMENTATION`) and chosen on the model's configs by
`experts_rows_alike`; an experts class this does not know (a post-expert norm) keeps its own forward.
"""

from __future__ import annotations

import torch

IMPLEMENTATION = "kto_rows_alike"
ROWS = 16  # rows of each block: every row of a block computes alike in every position (measured on the CPU)


def _product(rows: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`rows @ weight` (transposed: weight is (in, out)) or `rows @ weight.T`, in blocks of ROWS rows."""
    n, width = rows.shape
    blocks = -(-n // ROWS)
    padded = torch.cat([rows, rows.new_zeros(blocks * ROWS - n, width)]).view(blocks, ROWS, width)
    matrix = weight if transposed else weight.t()
    return torch.bmm(padded, matrix.expand(blocks, *matrix.shape)).reshape(blocks * ROWS, -1)[:n]


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """An experts module's forward (as transformers' eager loop: expert by expert, each expert's tokens gathered, the
    weighted outputs added back in expert order), with every product in blocks of ROWS rows."""
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit:
        expert = expert[0]
        if expert == self.num_experts:
            continue
        position, token = torch.where(mask[expert])
        state = hidden_states[token]
        if self.has_gate:
            gate_up = _product(state, self.gate_up_proj[expert], self.is_transposed)
            if self.has_bias:
                gate_up = gate_up + self.gate_up_proj_bias[expert]
            state = self._apply_gate(gate_up)
        else:
            state = _product(state, self.up_proj[expert], self.is_transposed)
            if self.has_bias:
                state = state + self.up_proj_bias[expert]
            state = self.act_fn(state)
        state = _product(state, self.down_proj[expert], self.is_transposed)
        if self.has_bias:
            state = state + self.down_proj_bias[expert]
        out.index_add_(0, token, (state * top_k_weights[token, position, None]).to(out.dtype))
    return out


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


def experts_rows_alike(model: torch.nn.Module) -> bool:
    """Make `model`'s experts modules compute each token alike (`experts_forward`), where transformers dispatches
    them through its experts implementations and their layout is one this knows. Whether any did."""
    configs = []
    for module in model.modules():
        known = all(hasattr(module, name) for name in ("has_gate", "has_bias", "is_transposed", "down_proj"))
        if not known or getattr(module, "has_post_expert_norm", False):
            continue
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            configs.append(config)
    if not configs:
        return False
    _register()
    for config in configs:
        config._experts_implementation = IMPLEMENTATION
    return True
