"""Hugging Face checkpoints in and out, against ``transformers`` itself.

Tiny GPT-2, BERT and ViT models are built with ``transformers`` (random parameters of
realistic size: kernels N(0, 1/fan_in), LayerNorm gains near 1, biases of size 0.1),
saved with ``save_pretrained`` and loaded with ``ocformer.convert.from_pretrained``.
References are the ``transformers`` models in float64 on CPU. Recovery means a maximum
relative error below 1e-10 in float64 and 1e-5 in float32 (measured: at most 1.1e-15
and 4.9e-7); a round trip HF -> ocformer -> HF (``to_pretrained``, reloaded by
``transformers``) gives the same outputs to the same bounds.
"""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

from ocformer.convert import (
    SUPPORTED_MODEL_TYPES,
    from_layers,
    from_pretrained,
    to_layers,
    to_pretrained,
)
from ocformer.models import Pooler, Readout, SequenceModel, TiedReadout, refine

F64_TOL = 1e-10
F32_TOL = 1e-5
VOCAB, POSITIONS = 37, 16


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Parameters of realistic size; transformers' own init (std 0.02) would make every
    layer nearly the identity and the comparison weak."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            norm = any(s in name for s in ("LayerNorm", "ln_", "layernorm"))
            if norm and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * z)
            elif p.ndim == 1:
                p.copy_(0.1 * z)
            elif any(s in name for s in ("embeddings", "wte", "wpe", "cls_token")):
                p.copy_(z)
            else:
                p.copy_(z / np.sqrt(min(p.shape[-2:]) if p.ndim == 2 else np.prod(p.shape[1:])))
    return model.double().eval()


def make_gpt2(seed=0, **kw):
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=24, n_layer=3, n_head=4, **kw
    )
    return randomise(GPT2LMHeadModel(config), seed)


def make_bert(seed=1, **kw):
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        num_hidden_layers=3,
        num_attention_heads=3,
        intermediate_size=40,
        max_position_embeddings=POSITIONS,
        **kw,
    )
    return randomise(BertModel(config), seed)


def make_vit(seed=2, cls=ViTForImageClassification, **kw):
    config = ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=kw.pop("num_channels", 1),
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        num_labels=10,
        **kw,
    )
    return randomise(cls(config), seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved checkpoint per family: {name: (path, torch model)}."""
    root = tmp_path_factory.mktemp("hf")
    models = {
        "gpt2": make_gpt2(),
        "bert": make_bert(),
        "vit": make_vit(),
        "vit_pooler": make_vit(seed=3, cls=ViTModel, num_channels=3, qkv_bias=False),
    }
    out = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        out[name] = (str(root / name), model)
    return out


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (3, 11))  # shorter than the 16 positions
    mask = np.ones((3, 11), bool)
    mask[1, 7:] = False  # padding at the end of one sequence
    mask[2, 3] = False  # and a masked key inside another
    types = rng.integers(0, 2, (3, 11))
    images = rng.standard_normal((4, 1, 8, 8))
    rgb = rng.standard_normal((2, 3, 8, 8))
    return {"ids": ids, "mask": mask, "types": types, "images": images, "rgb": rgb}


def _t(x):
    return torch.tensor(np.asarray(x))


def reference(name, model, inputs):
    """The transformers model's outputs, float64, as a dict of numpy arrays."""
    with torch.no_grad():
        if name == "gpt2":
            masked = model(_t(inputs["ids"]), attention_mask=_t(inputs["mask"].astype(np.int64)))
            short = model(_t(inputs["ids"][:1, :4]))
            return {"logits": masked.logits, "short": short.logits}
        if name == "bert":
            out = model(
                _t(inputs["ids"]),
                attention_mask=_t(inputs["mask"].astype(np.int64)),
                token_type_ids=_t(inputs["types"]),
            )
            plain = model(_t(inputs["ids"][:, :5]))
            return {
                "hidden": out.last_hidden_state,
                "pooled": out.pooler_output,
                "plain": plain.last_hidden_state,
            }
        if name == "vit":
            return {"logits": model(_t(inputs["images"])).logits}
        out = model(_t(inputs["rgb"]))
        return {"hidden": out.last_hidden_state, "pooled": out.pooler_output}


def ours(name, model, inputs, only=None):
    """The same outputs from an ocformer ``SequenceModel`` (or only one of them)."""
    if only is not None:
        return {only: _ours(name, model, inputs)[only]()}
    return {k: f() for k, f in _ours(name, model, inputs).items()}


def _ours(name, model, inputs):
    if name == "gpt2":
        return {
            "logits": lambda: model.logits(inputs["ids"], inputs["mask"]),
            "short": lambda: model.logits(inputs["ids"][:1, :4]),
        }
    if name == "bert":
        return {
            "hidden": lambda: model.hidden_states(inputs["ids"], inputs["mask"], inputs["types"]),
            "pooled": lambda: model.logits(inputs["ids"], inputs["mask"], inputs["types"]),
            "plain": lambda: model.hidden_states(inputs["ids"][:, :5]),
        }
    if name == "vit":
        return {"logits": lambda: model.logits(inputs["images"].transpose(0, 2, 3, 1))}
    rgb = inputs["rgb"].transpose(0, 2, 3, 1)
    return {"hidden": lambda: model.hidden_states(rgb), "pooled": lambda: model.logits(rgb)}


def assert_close(name, got, ref, tol):
    assert set(got) == set(ref)
    for k in ref:
        err = rel_err(got[k], ref[k])
        assert err < tol, f"{name} {k}: relative error {err:.2e} >= {tol:.0e}"


FAMILIES = ("gpt2", "bert", "vit", "vit_pooler")


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers_float64(saved, inputs, name):
    path, hf = saved[name]
    model = from_pretrained(path, dtype=np.float64)
    assert model.transformer.control.values.attention.wq.dtype == np.float64
    assert_close(name, ours(name, model, inputs), reference(name, hf, inputs), F64_TOL)


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers_float32(saved, inputs, name):
    path, hf = saved[name]
    model = from_pretrained(path, dtype=np.float32)
    main = {"gpt2": "logits", "bert": "hidden", "vit": "logits", "vit_pooler": "hidden"}[name]
    got = ours(name, model, inputs, only=main)
    assert all(np.asarray(v).dtype == np.float32 for v in got.values())
    assert_close(name, got, {main: reference(name, hf, inputs)[main]}, F32_TOL)


def test_loads_and_writes_bfloat16(saved, inputs, tmp_path):
    """``dtype=jnp.bfloat16`` (an ml_dtypes type, which NumPy does not count as
    floating) was refused as not floating. The model's arrays are the checkpoint's
    rounded to bfloat16, its logits within bfloat16's rounding of the float32 model's,
    and it writes a bfloat16 checkpoint that transformers reads with those arrays."""
    import jax.numpy as jnp

    path, hf = saved["gpt2"]
    model = from_pretrained(path, dtype=jnp.bfloat16)
    wq = model.transformer.control.values.attention.wq
    assert wq.dtype == jnp.bfloat16
    ref = hf.transformer.h[0].attn.c_attn.weight.detach().numpy()[:, :24]
    np.testing.assert_array_equal(np.asarray(wq[0]), ref.astype(jnp.bfloat16))
    logits = model.logits(inputs["ids"], inputs["mask"])
    assert logits.dtype == jnp.bfloat16
    full = reference("gpt2", hf, inputs)["logits"]
    assert 1e-4 < rel_err(np.asarray(logits, np.float64), full) < 3e-2
    to_pretrained(model, tmp_path / "out")
    again = GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert again.dtype == torch.bfloat16
    back = again.transformer.h[0].attn.c_attn.weight.detach().float().numpy()[:, :24]
    np.testing.assert_array_equal(back, np.asarray(wq[0], np.float32))


def test_heads_and_settings(saved):
    gpt2 = from_pretrained(saved["gpt2"][0])
    t = gpt2.transformer
    assert (t.norm, t.attention.causal, t.feedforward.activation) == ("pre", True, "gelu_tanh")
    bert = from_pretrained(saved["bert"][0])
    assert (bert.transformer.norm, bert.transformer.feedforward.activation) == ("post", "gelu")
    assert bert.transformer.layer_norm.eps == 1e-12
    # The checkpoint's dtype is kept when none is asked for.
    assert gpt2.embedding.tokens.dtype == np.float64
    # One model class; the heads are readouts of it.
    vit, vit_pooler = from_pretrained(saved["vit"][0]), from_pretrained(saved["vit_pooler"][0])
    for model in (gpt2, bert, vit, vit_pooler):
        assert type(model) is SequenceModel
    assert gpt2.tied and gpt2.head is None and isinstance(gpt2.readout, TiedReadout)
    assert gpt2.readout.tokens is gpt2.embedding.tokens  # the tie: one table
    assert isinstance(bert.head, Pooler) and isinstance(vit_pooler.head, Pooler)
    assert isinstance(vit.head, Readout) and vit.head.pooling == "cls"


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip(saved, inputs, tmp_path, name):
    path, hf = saved[name]
    model = from_pretrained(path)
    to_pretrained(model, tmp_path / "out")
    cls = type(hf)
    again = cls.from_pretrained(tmp_path / "out").eval()
    assert again.dtype == torch.float64
    assert_close(name, reference(name, again, inputs), reference(name, hf, inputs), F64_TOL)
    # ... and ocformer reads its own output back to the same model.
    assert_close(name, ours(name, from_pretrained(tmp_path / "out"), inputs),
                 ours(name, model, inputs), F64_TOL)  # fmt: skip


def _rewrite(src, dst, rename=lambda k: k, extra=None, drop=()):
    tensors = {rename(k): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    tensors = {k: v for k, v in tensors.items() if k not in drop} | (extra or {})
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return config


def test_hub_key_spellings(saved, inputs, tmp_path):
    """Hub checkpoints: GPT-2 without ``transformer.`` and with its causal-mask buffers,
    BERT with ``bert.`` and LayerNorm gamma/beta, ViT's base model with ``vit.``."""
    gpt2 = tmp_path / "gpt2"
    _rewrite(
        saved["gpt2"][0],
        gpt2,
        rename=lambda k: k.removeprefix("transformer."),
        extra={"h.0.attn.bias": np.tril(np.ones((1, 1, POSITIONS, POSITIONS), np.float32))},
    )
    bert = tmp_path / "bert"
    _rewrite(
        saved["bert"][0],
        bert,
        rename=lambda k: (
            "bert."
            + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                "LayerNorm.bias", "LayerNorm.beta"
            )
        ),
        extra={"bert.embeddings.position_ids": np.arange(POSITIONS)[None]},
    )
    vit = tmp_path / "vit"
    _rewrite(saved["vit_pooler"][0], vit, rename=lambda k: "vit." + k)
    for name, path in (("gpt2", gpt2), ("bert", bert), ("vit_pooler", vit)):
        got = ours(name, from_pretrained(path), inputs)
        assert_close(name, got, reference(name, saved[name][1], inputs), F64_TOL)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_config_without_epsilon_or_activation_reads_transformers_defaults(
    saved, inputs, tmp_path, name
):
    """``transformers`` reads an absent ``layer_norm_eps`` or activation as its
    configuration class's default (a hand-written or minimal ``config.json``); they
    were refused as ``None``."""
    path, hf = saved[name]
    keys = ("activation_function", "layer_norm_epsilon") if name == "gpt2" else (
        "hidden_act", "layer_norm_eps"
    )  # fmt: skip
    config = _rewrite(path, tmp_path / name)
    defaults = type(hf.config)()
    assert all(config[k] == getattr(defaults, k) for k in keys)  # what hf ran with
    with open(tmp_path / name / "config.json", "w") as f:
        json.dump({k: v for k, v in config.items() if k not in keys}, f)
    got = ours(name, from_pretrained(tmp_path / name, dtype=np.float64), inputs)
    assert_close(name, got, reference(name, hf, inputs), F64_TOL)


def test_gpt2_reorder_and_upcast_attn_changes_only_rounding(inputs, tmp_path):
    """Accepted (the docs say why): its float64 outputs are the same function's."""
    hf = make_gpt2(seed=5, reorder_and_upcast_attn=True)
    hf.save_pretrained(tmp_path / "gpt2")
    got = ours("gpt2", from_pretrained(tmp_path / "gpt2", dtype=np.float64), inputs)
    assert_close("gpt2", got, reference("gpt2", hf, inputs), F64_TOL)


def test_sharded_checkpoint(saved, inputs, tmp_path):
    path, hf = saved["bert"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, tmp_path / file, metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(Path(path, "config.json").read_text())
    got = ours("bert", from_pretrained(tmp_path), inputs)
    assert_close("bert", got, reference("bert", hf, inputs), F64_TOL)
    os.remove(tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=r"shard files that are not in .*b\.safetensors"):
        from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------
# Bad input: clear errors, raised before anything is built.


def test_missing_files(saved, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="has no config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(Path(saved["gpt2"][0], "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"neither model.safetensors .*pytorch_model.bin"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.999], ids=["header_cut", "data_cut"])
def test_truncated_weights_name_the_file(saved, tmp_path, keep):
    """A truncated model.safetensors (in its header, or in its data) is a ValueError that
    names the file, not the safetensors library's bare error."""
    source = Path(saved["gpt2"][0])
    (tmp_path / "config.json").write_bytes((source / "config.json").read_bytes())
    data = (source / "model.safetensors").read_bytes()
    cut = int(len(data) * keep) if keep > 0.9 else 20
    (tmp_path / "model.safetensors").write_bytes(data[:cut])
    weights = str(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="truncated or damaged") as e:
        from_pretrained(tmp_path)
    assert weights in str(e.value)


def test_unsupported_model_type(saved, tmp_path):
    config = _rewrite(saved["gpt2"][0], tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama' is not supported") as e:
        from_pretrained(tmp_path)
    assert all(t in str(e.value) for t in SUPPORTED_MODEL_TYPES)


def test_unsupported_options(saved, tmp_path):
    config = _rewrite(saved["bert"][0], tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_act": "silu"}))
    with pytest.raises(ValueError, match="hidden_act='silu' is not supported"):
        from_pretrained(tmp_path)
    kind = {"position_embedding_type": "relative_key"}
    (tmp_path / "config.json").write_text(json.dumps(config | kind))
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        from_pretrained(tmp_path)
    # Every unsupported option is named at once, not one per attempt.
    (tmp_path / "config.json").write_text(json.dumps(config | kind | {"is_decoder": True}))
    with pytest.raises(ValueError) as e:
        from_pretrained(tmp_path)
    assert str(e.value) == (
        "config.json: position_embedding_type='relative_key' (supported: ['absolute']); "
        "is_decoder=True (supported: [False]) are not supported for bert; the continuous "
        "model would not reproduce them."
    )


def test_missing_and_extra_tensors(saved, tmp_path):
    _rewrite(saved["gpt2"][0], tmp_path / "missing", drop={"transformer.h.1.mlp.c_fc.bias"})
    with pytest.raises(ValueError, match=r"missing tensors \['h\.1\.mlp\.c_fc\.bias'\]"):
        from_pretrained(tmp_path / "missing")
    extra = {"cls.predictions.bias": np.zeros(VOCAB, np.float64)}
    _rewrite(saved["bert"][0], tmp_path / "extra", extra=extra)
    with pytest.raises(ValueError, match=r"unexpected tensors \['cls\.predictions\.bias'\]"):
        from_pretrained(tmp_path / "extra")
    # Left out on request (BERT checkpoints on the Hub carry their pre-training heads).
    kept = from_pretrained(tmp_path / "extra", ignore=("cls.",))
    assert kept.embedding.tokens.shape == (VOCAB, 24)
    # A head with part of its tensors is missing the rest.
    _rewrite(saved["vit"][0], tmp_path / "head", drop={"classifier.bias"})
    with pytest.raises(ValueError, match=r"missing tensors \['classifier\.bias'\]"):
        from_pretrained(tmp_path / "head")
    # The same parameter with and without the prefix.
    twice = {"wte.weight": np.zeros((VOCAB, 24))}
    _rewrite(saved["gpt2"][0], tmp_path / "twice", extra=twice)
    with pytest.raises(ValueError, match="spelt twice"):
        from_pretrained(tmp_path / "twice")


def test_shapes_disagree_with_config(saved, tmp_path):
    config = _rewrite(saved["gpt2"][0], tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"n_inner": 64}))
    with pytest.raises(
        ValueError,
        match=r"'transformer\.h\.0\.mlp\.c_fc\.weight' has shape \(24, 96\), but config\.json "
        r"implies \(24, 64\)",
    ):
        from_pretrained(tmp_path)


def test_to_pretrained_refuses_other_discretisations(saved, tmp_path):
    model = from_pretrained(saved["gpt2"][0])
    fine = model.with_transformer(refine(model.transformer, 2))
    with pytest.raises(ValueError, match=r"differs: steps_per_layer=2 \(standard: 1\);"):
        to_pretrained(fine, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")  # nothing written
    with pytest.raises(ValueError, match="takes an ocformer.models.SequenceModel"):
        to_pretrained(model.transformer, tmp_path / "out")


@pytest.mark.parametrize("family", ["gpt2", "bert", "vit"])
def test_to_pretrained_refuses_a_source_config_that_no_longer_describes_the_model(
    saved, tmp_path, family
):
    """A model from from_pretrained whose transformer was replaced keeps its source's
    config.json: written with it, transformers computed another function (GPT-2 with
    ReLU: 22 % off; non-causal: 83 %) or initialised a missing layer at random. Each
    difference is refused and named; the unchanged model still exports."""
    model = from_pretrained(saved[family][0])
    t = model.transformer
    layers = to_layers(t)
    options = dict(
        norm=t.norm, num_heads=t.attention.num_heads, activation=t.feedforward.activation,
        causal=t.attention.causal, ln_eps=t.layer_norm.eps,
        final_norm=None if t.final_norm is None else {
            "scale": np.asarray(t.final_norm.scale), "bias": np.asarray(t.final_norm.bias)
        },
    )  # fmt: skip
    same = model.with_transformer(from_layers(layers, **options))
    to_pretrained(same, tmp_path / "same")
    other = "gelu" if options["activation"] == "relu" else "relu"
    heads = 2 if options["num_heads"] != 2 else 1
    for change, said in (
        (dict(activation=other), f"activation {other!r} (the configuration: "),
        (dict(ln_eps=0.125), "LayerNorm epsilon 0.125 (the configuration: "),
        (dict(causal=not options["causal"]), "causal attention "),
        (dict(num_heads=heads), f"attention heads {heads} (the configuration: "),
    ):
        changed = model.with_transformer(from_layers(layers, **(options | change)))
        with pytest.raises(ValueError, match="does not describe it: " + re.escape(said)):
            to_pretrained(changed, tmp_path / "out")
        assert not os.path.exists(tmp_path / "out")  # nothing written
    shorter = model.with_transformer(from_layers(layers[:1], **options))
    with pytest.raises(ValueError, match=r"does not describe it: .* absent \(the configuration"):
        to_pretrained(shorter, tmp_path / "out")


# ---------------------------------------------------------------------------------------
# The export directory: never mixed with another checkpoint.


def _files(directory) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, name), directory): Path(root, name).read_bytes()
        for root, _, names in os.walk(directory)
        for name in names
    }


def _sharded_copy(src, dst) -> None:
    """The checkpoint of ``src`` as two shards and an index, in ``dst``."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-1-of-2.safetensors": names[::2], "model-2-of-2.safetensors": names[1::2]}
    os.makedirs(dst)
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, os.path.join(dst, file), metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, part in shards.items() for k in part}}
    Path(dst, "model.safetensors.index.json").write_text(json.dumps(index))
    Path(dst, "config.json").write_text(Path(src, "config.json").read_text())


def _siblings(directory) -> list[str]:
    return sorted(os.listdir(os.path.dirname(directory)))


def _assert_holds_only_the_export(target, hf, inputs):
    """``target`` holds ocformer's three files, nothing else (no stale shard, index or
    temporary sibling), and ``transformers`` loads from it the BERT ``hf``."""
    assert sorted(os.listdir(target)) == [
        "config.json",
        "model.safetensors",
        "ocformer_export.json",
    ]
    assert _siblings(target) == [os.path.basename(target)]
    again = BertModel.from_pretrained(target).eval()
    assert_close("bert", reference("bert", again, inputs), reference("bert", hf, inputs), F64_TOL)


def test_to_pretrained_refuses_a_directory_it_did_not_write(saved, tmp_path):
    bert = from_pretrained(saved["bert"][0])
    gpt2_dir, sharded = tmp_path / "gpt2", tmp_path / "sharded"
    _rewrite(saved["gpt2"][0], gpt2_dir)  # a GPT-2 save_pretrained directory
    _sharded_copy(saved["gpt2"][0], sharded)
    for target in (gpt2_dir, sharded):
        before = _files(target)
        with pytest.raises(FileExistsError, match=r"not written by ocformer.*overwrite=True"):
            to_pretrained(bert, target)
        assert _files(target) == before  # byte for byte
    assert _siblings(gpt2_dir) == ["gpt2", "sharded"]  # no temporary directory left


def test_to_pretrained_overwrite_replaces_the_whole_directory(saved, inputs, tmp_path):
    path, hf = saved["bert"]
    target = tmp_path / "sharded"
    _sharded_copy(saved["gpt2"][0], target)
    to_pretrained(from_pretrained(path), target, overwrite=True)
    # No stale shard or index of the GPT-2 checkpoint is left next to the new file.
    _assert_holds_only_the_export(target, hf, inputs)


def test_to_pretrained_reexports_into_its_own_directory(saved, inputs, tmp_path):
    target = tmp_path / "out"
    to_pretrained(from_pretrained(saved["gpt2"][0]), target)
    # Every file has the user's umask (safetensors made its weights 0600).
    modes = {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    path, hf = saved["bert"]
    to_pretrained(from_pretrained(path), target)  # an export of ocformer's: replaced whole
    _assert_holds_only_the_export(target, hf, inputs)
    # A file the user added (a tokenizer, say) is not ocformer's: the export is refused.
    (target / "vocab.txt").write_text("[PAD]\n")
    before = _files(target)
    with pytest.raises(
        FileExistsError, match=r"files that ocformer did not write: \['vocab.txt'\]"
    ):
        to_pretrained(from_pretrained(path), target)
    assert _files(target) == before


def test_an_export_killed_between_its_renames_is_put_back_by_the_next(saved, inputs, tmp_path):
    """A kill between the two renames of a replacing export leaves the old export aside
    (hidden) and nothing at the path; the next export there puts it back, removes a
    dead export's staging directory, leaves a running one's alone, and replaces the old
    export as usual (it is ocformer's)."""
    import subprocess
    import sys

    target = tmp_path / "out"
    to_pretrained(from_pretrained(saved["gpt2"][0]), target)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    os.rename(target, tmp_path / f".out.old-{dead}-0123abcd")
    (tmp_path / f".out.tmp-{dead}-89abcdef").mkdir()
    running = tmp_path / f".out.tmp-{os.getppid()}-00000000"
    running.mkdir()
    from ocformer.convert._directory import recover_interrupted

    recover_interrupted(str(target))
    assert (target / "ocformer_export.json").exists()  # the old export, back
    assert _siblings(target) == sorted([running.name, "out"])
    path, hf = saved["bert"]
    os.rename(target, tmp_path / f".out.old-{dead}-0123abcd")  # killed again
    to_pretrained(from_pretrained(path), target)
    running.rmdir()
    _assert_holds_only_the_export(target, hf, inputs)


def test_to_pretrained_into_a_file_is_a_value_error(saved, tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"not a directory")
    with pytest.raises(ValueError, match="is a file") as info:
        to_pretrained(from_pretrained(saved["gpt2"][0]), file)
    assert not isinstance(info.value, FileExistsError)
    assert file.read_bytes() == b"not a directory"
    assert _siblings(file) == ["model.safetensors"]
    with pytest.raises(ValueError, match="model.safetensors' above it is a file"):
        to_pretrained(from_pretrained(saved["gpt2"][0]), file / "deeper" / "export")
    assert _siblings(file) == ["model.safetensors"]


def test_to_pretrained_into_a_symbolic_link_is_refused(saved, tmp_path):
    """A link to an earlier export was replaced by a new directory, its target kept the
    old weights, and a hidden link was left beside it: refused, naming the target."""
    model = from_pretrained(saved["gpt2"][0])
    target, link = tmp_path / "export", tmp_path / "link"
    to_pretrained(model, target)
    link.symlink_to(target)
    before = _files(target)
    with pytest.raises(ValueError, match=r"is a symbolic link .*give the directory itself"):
        to_pretrained(model, link)
    assert link.is_symlink() and _files(target) == before
    assert sorted(os.listdir(tmp_path)) == ["export", "link"]
    to_pretrained(model, target)  # the directory itself, replaced as usual


def test_to_pretrained_writes_extra_files_it_may_replace(saved, tmp_path):
    """A tokenizer written with the checkpoint is ocformer's: listed in the marker, and
    a later export into the directory is allowed; a bad name is refused unwritten."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": {"type": "BPE"}}')
    model, target = from_pretrained(saved["gpt2"][0]), tmp_path / "out"
    to_pretrained(model, target, files={"tokenizer.json": tokenizer})
    assert (target / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    marker = json.loads((target / "ocformer_export.json").read_text())
    assert marker["files"] == ["tokenizer.json"]
    to_pretrained(model, target)  # replaced whole: the tokenizer goes with the old export
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors",
                                          "ocformer_export.json"]  # fmt: skip
    for name in ("../tokenizer.json", "config.json"):
        with pytest.raises(ValueError, match="plain file name"):
            to_pretrained(model, tmp_path / "other", files={name: tokenizer})
    assert not os.path.exists(tmp_path / "other")
