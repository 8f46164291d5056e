"""Small models with awkward shapes for the runtime tests (imported by test modules; not a test itself)."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d=33, hidden=70):
        super().__init__()
        self.l1 = nn.Linear(d, hidden)
        self.l2 = nn.Linear(hidden, d)
        self.gain = nn.Parameter(torch.ones(2))  # smaller than most world sizes

    def reset_parameters(self):  # the gain's own init, so that every param of the model has one
        nn.init.ones_(self.gain)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x))) * self.gain.mean()


class Awkward(nn.Module):
    """A 1000x257 linear, a bias of 7, an embedding of 1001 rows tied to the head, a 2-element param."""

    def __init__(self, d=33, vocab=1001, n_blocks=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.wide_in = nn.Linear(d, 257)
        self.wide = nn.Linear(257, 1000)
        self.narrow = nn.Linear(1000, 7)
        self.back = nn.Linear(7, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.block_call = None  # e.g. activation checkpointing: lambda block, x: checkpoint(block, x, ...)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.layers:
            x = b(x) if self.block_call is None else self.block_call(b, x)
        x = x + self.back(self.narrow(torch.relu(self.wide(torch.relu(self.wide_in(x))))))
        return self.head(x)


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    return Awkward(**kw)


def batch(step, n=12, seq=5, vocab=1001):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, vocab, (n, seq), generator=g)


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def shard(model, fully_shard, **kw):
    for b in model.layers:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def local_rows(t, rank, world_size):
    per = t.shape[0] // world_size
    return t[rank * per : (rank + 1) * per]


class TwoLinear(nn.Module):
    """8 -> 8 -> 4, seeded: the small model of the fault and misuse tests."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def shard_two_linear(fully_shard, **kw):
    m = TwoLinear()
    fully_shard(m.a, **kw)
    fully_shard(m.b, **kw)
    fully_shard(m, **kw)
    return m


class Mats(nn.Module):
    """Matrices of the given shapes and a 5-element bias, seeded: the optimizer tests' sharded model."""

    def __init__(self, shapes, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(*s, generator=g)) for s in shapes])
        self.bias = nn.Parameter(torch.randn(5, generator=g))

    def ordered(self):
        return list(self.ws) + [self.bias]


def grads_for(shapes, step, seed):
    """Step ``step``'s full grads of ``Mats(shapes, seed)`` (matrices, then the bias), the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(*s, generator=g) for s in shapes] + [torch.randn(5, generator=g)]


def tiny_llama(seed=0, **config):
    """A tiny transformers ``LlamaForCausalLM`` built from a config (no download), seeded; ``config`` overrides."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **config}))


class Boom(RuntimeError):
    """What a user's forward or backward raises in the failure tests."""


class RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises :class:`Boom`."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise Boom("the user's backward raised")


def _err(fn):
    """The exception ``fn()`` raises, as ``Type: message``; None if it returns (the misuse tests)."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
