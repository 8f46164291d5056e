"""The small GPT (presets, meta build, deterministic init, causality) and the stdlib-source byte data."""

from __future__ import annotations

import math
import os
import sysconfig

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_optim.data import VOCAB_SIZE, get_batch, load_corpus, stdlib_source_files
from ragged_optim.models import PRESETS, GPTConfig, build_meta_model, build_model, get_config, num_params


@pytest.mark.parametrize(
    "preset, lo, hi",
    [("tiny", 80_000, 160_000), ("small", 1_000_000, 2_000_000), ("bench20m", 17_000_000, 23_000_000)],
)
def test_preset_sizes(preset, lo, hi):
    model = build_meta_model(preset)
    assert lo <= num_params(model) <= hi
    assert all(p.is_meta for p in model.parameters())


def test_meta_build_materialises_to_the_cpu_build():
    ref = build_model("tiny", seed=3)
    meta = build_meta_model("tiny")
    meta.materialize("cpu", seed=3)
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), meta.named_parameters(), strict=True):
        assert n1 == n2
        assert torch.equal(p1, p2), n1
    assert meta.head.weight is meta.tok_emb.weight


def test_init_is_deterministic_and_seeded():
    a, b, c = build_model("tiny", seed=0), build_model("tiny", seed=0), build_model("tiny", seed=1)
    torch.manual_seed(123)  # the global RNG plays no part
    d = build_model("tiny", seed=0)
    for pa, pb, pd in zip(a.parameters(), b.parameters(), d.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pd)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_layers_is_a_modulelist_and_untied_option():
    model = build_model("tiny")
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == PRESETS["tiny"].n_layers
    untied = build_model(get_config("tiny", tie_embeddings=False, bias=False, ln_bias=False))
    assert untied.head.weight is not untied.tok_emb.weight
    assert num_params(untied) > num_params(model)
    assert untied.layers[0].attn.qkv.bias is None and untied.ln_f.bias is None


def test_forward_shapes_loss_and_causality():
    cfg = get_config("tiny")
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    assert abs(model(idx, targets).item() - math.log(cfg.vocab_size)) < 0.3
    changed = idx.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % cfg.vocab_size
    assert torch.allclose(model(changed)[:, :40], logits[:, :40], atol=1e-6)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_bad_config_and_preset():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_config("huge")


def _walk_order(root: str) -> list[str]:
    """The order stdlib_source_files promises, built without os.walk: a folder's own .py files (sorted), then each
    subfolder (sorted) depth first; site-packages, dist-packages and __pycache__ are skipped, symlinked folders
    are not entered."""
    names = sorted(os.listdir(root))
    paths = [os.path.join(root, n) for n in names]
    out = [p for p in paths if p.endswith(".py") and not os.path.isdir(p)]
    for n, p in zip(names, paths):
        if os.path.isdir(p) and not os.path.islink(p) and n not in ("site-packages", "dist-packages", "__pycache__"):
            out += _walk_order(p)
    return out


def test_source_file_order_on_a_known_tree(tmp_path):
    for rel in ["b.py", "a.py", "notes.txt", "a/f.py", "z/c.py", "m/n/e.py", "m/d.py", "m/g.pyc"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for skipped in ["site-packages", "dist-packages", "__pycache__", "m/__pycache__"]:
        (tmp_path / skipped).mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped / "x.py").write_text("")
    # files before subfolders: a plain sorted() of the paths would put a/f.py first
    expected = ["a.py", "b.py", "a/f.py", "m/d.py", "m/n/e.py", "z/c.py"]
    assert stdlib_source_files(str(tmp_path)) == [str(tmp_path / e) for e in expected]


def test_corpus_is_stdlib_bytes():
    files = stdlib_source_files()
    assert len(files) > 100 and all(f.endswith(".py") and os.path.isfile(f) for f in files)
    assert len(set(files)) == len(files)
    assert stdlib_source_files() == files  # the same list on every call: ranks and reruns read the same bytes
    assert files == _walk_order(sysconfig.get_paths()["stdlib"])
    assert not any("site-packages" in f for f in files)
    corpus = load_corpus()
    assert corpus.train.dtype == torch.uint8 and len(corpus.train) > 1_000_000
    assert len(corpus.val) > 100_000
    assert load_corpus() is corpus  # cached


def test_batch_is_deterministic_shifted_and_split_dependent():
    x, y = get_batch("train", 8, 32, step=5, seed=1)
    x2, y2 = get_batch("train", 8, 32, step=5, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.dtype == torch.long and x.shape == (8, 32) and int(x.max()) < VOCAB_SIZE
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, get_batch("train", 8, 32, step=6, seed=1)[0])
    assert not torch.equal(x, get_batch("train", 8, 32, step=5, seed=2)[0])
    assert not torch.equal(x, get_batch("val", 8, 32, step=5, seed=1)[0])


@settings(max_examples=25, deadline=None)
@given(world_size=st.integers(1, 8), per_rank=st.integers(1, 4), step=st.integers(0, 10_000), seed=st.integers(0, 99))
def test_rank_batches_concatenate_to_the_global_batch(world_size, per_rank, step, seed):
    batch = world_size * per_rank
    gx, gy = get_batch("train", batch, 16, step, seed=seed)
    parts = [get_batch("train", batch, 16, step, rank=r, world_size=world_size, seed=seed) for r in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_batch_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        get_batch("train", 6, 16, 0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        get_batch("train", 8, 16, 0, rank=4, world_size=4)
    with pytest.raises(ValueError, match="split"):
        get_batch("test", 8, 16, 0)
