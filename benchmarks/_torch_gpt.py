"""The PyTorch reference: the same GPT as ``_flax_gpt``, on the CPU, float32.

torch is optional (``pip install -e '.[bench]'``); without it ``torch`` is None and the
benchmark reports why it has no PyTorch figure.
"""

import math

import numpy as np

from ocformer.convert import to_layers

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # the optional `bench` extra is not installed
    torch = None

from ._gpt import GPTShape

TORCH_MISSING = (
    "torch is not installed; install the optional extra with "
    "`.venv/bin/python -m pip install -e '.[bench]'` (torch==2.13.0, CPU)"
)

if torch is not None:

    class Block(nn.Module):
        def __init__(self, s: GPTShape):
            super().__init__()
            d = s.width
            self.heads = s.heads
            self.ln1 = nn.LayerNorm(d, eps=s.ln_eps)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d, eps=s.ln_eps)
            self.fc = nn.Linear(d, s.hidden)
            self.out = nn.Linear(s.hidden, d)
            self.approximate = "tanh" if s.approximate_gelu else "none"

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, n, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(z.transpose(1, 2).reshape(b, n, d))
            h = F.gelu(self.fc(self.ln2(x)), approximate=self.approximate)
            return x + self.out(h)

    class GPT(nn.Module):
        def __init__(self, s: GPTShape):
            super().__init__()
            self.tokens = nn.Embedding(s.vocab, s.width)
            self.positions = nn.Parameter(torch.randn(s.seq_len, s.width))
            self.blocks = nn.ModuleList([Block(s) for _ in range(s.layers)])
            self.ln_f = nn.LayerNorm(s.width, eps=s.ln_eps)
            self.head = nn.Linear(s.width, s.vocab)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=1 / math.sqrt(m.in_features))
                    nn.init.zeros_(m.bias)

        def forward(self, tokens):
            x = self.tokens(tokens) + self.positions[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

else:
    Block = GPT = None


def load_ocformer(gpt, model) -> None:
    """Copy ocformer's ``SequenceModel`` parameters into ``gpt`` (the same function)."""
    t = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
    layers = to_layers(model.transformer)
    final = model.transformer.final_norm
    with torch.no_grad():
        gpt.tokens.weight.copy_(t(model.embedding.tokens))
        gpt.positions.copy_(t(model.embedding.positions))
        gpt.ln_f.weight.copy_(t(final.scale))
        gpt.ln_f.bias.copy_(t(final.bias))
        gpt.head.weight.copy_(t(model.readout.weight).T)
        gpt.head.bias.copy_(t(model.readout.bias))
        for block, p in zip(gpt.blocks, layers, strict=True):
            block.ln1.weight.copy_(t(p["ln1_scale"]))
            block.ln1.bias.copy_(t(p["ln1_bias"]))
            block.qkv.weight.copy_(t(np.concatenate([p["wq"], p["wk"], p["wv"]], axis=1)).T)
            block.qkv.bias.copy_(t(np.concatenate([p["bq"], p["bk"], p["bv"]])))
            block.proj.weight.copy_(t(p["wo"]).T)
            block.proj.bias.copy_(t(p["bo"]))
            block.ln2.weight.copy_(t(p["ln2_scale"]))
            block.ln2.bias.copy_(t(p["ln2_bias"]))
            block.fc.weight.copy_(t(p["w1"]).T)
            block.fc.bias.copy_(t(p["b1"]))
            block.out.weight.copy_(t(p["w2"]).T)
            block.out.bias.copy_(t(p["b2"]))


def make_train_step(gpt, forward, opt_cfg, clip_norm: float | None):
    """``step(inputs, targets) -> loss``: forward, backward, clipping and AdamW with the
    experiment's hyperparameters (a constant learning rate: the schedule costs nothing)."""
    optimiser = torch.optim.AdamW(
        gpt.parameters(),
        lr=opt_cfg.learning_rate,
        betas=(opt_cfg.b1, opt_cfg.b2),
        eps=1e-8,
        weight_decay=opt_cfg.weight_decay,
        foreach=True,
    )

    def step(inputs, targets):
        optimiser.zero_grad(set_to_none=True)
        logits = forward(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), clip_norm)
        optimiser.step()
        return loss

    return step
