"""The GPT shape shared by the references, and its FLOP count.

FLOP convention (model FLOPs, as in MFU): a multiply-add is 2 FLOPs; a training step
is 3 x the forward pass; per token the forward pass costs 2 N (N: parameters of the
matrix products, i.e. the attention and feed-forward kernels and the readout; the
embeddings are look-ups) plus 4 L d T for the attention scores and their weighted sum
(L layers, width d, context T; the causal mask is not discounted). Layer norms,
softmax, GELU, the optimiser and any recomputation are not counted. This is 6 N + 12 L
d T per token (Chowdhery et al., PaLM, appendix B).
"""

import dataclasses

from ocformer.config import Config


@dataclasses.dataclass(frozen=True)
class GPTShape:
    vocab: int
    seq_len: int
    layers: int
    width: int
    heads: int
    hidden: int
    ln_eps: float = 1e-5
    approximate_gelu: bool = False

    def num_params(self) -> int:
        d, f, v = self.width, self.hidden, self.vocab
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        return v * d + self.seq_len * d + self.layers * block + 2 * d + d * v + v


def gpt_shape(config: Config, vocab: int) -> GPTShape:
    """The reference GPT's shape for ``config``; the references are pre-LN GELU GPTs."""
    m = config.model
    gelu = m.activation in ("gelu", "gelu_tanh")
    if m.norm != "pre" or not gelu or not m.final_norm or m.readout != "linear":
        raise ValueError(
            "The flax and PyTorch references are pre-LN GELU GPTs with a final LayerNorm "
            f"and a linear head; got model.norm={m.norm!r}, model.activation="
            f"{m.activation!r}, model.final_norm={m.final_norm!r}, model.readout="
            f"{m.readout!r}. Benchmark a configuration of that kind."
        )
    return GPTShape(
        vocab=vocab,
        seq_len=config.task.seq_len,
        layers=m.num_layers,
        width=m.width,
        heads=m.num_heads,
        hidden=m.hidden,
        ln_eps=m.ln_eps,
        approximate_gelu=m.activation == "gelu_tanh",
    )


def model_flops_per_token(s: GPTShape) -> float:
    """Training FLOPs per token under the convention of the module docstring."""
    matmul_params = s.layers * (4 * s.width**2 + 2 * s.width * s.hidden) + s.width * s.vocab
    return 6.0 * matmul_params + 12.0 * s.layers * s.width * s.seq_len
