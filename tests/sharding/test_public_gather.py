"""`ro.full_tensor` and `ro.full_grad` on ragged-sharded params and on their grads.

Before `full_grad` was exported and `full_tensor` learned to recognise a sharded param's `.grad`, `ro.full_grad`
was an AttributeError and `ro.full_tensor(p.grad)` silently returned the local 1-D piece (checked: this test failed
on both counts)."""

import torch
from fsdp_models import batch, local_rows, loss_fn, make_model, shard

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks


def _gathered(rank, world_size):
    model = shard(make_model(), ro.fully_shard)
    x, y = batch(0)
    loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
    out = {}
    for n, p in model.named_parameters():
        piece = p.grad.to_local()  # full_tensor recognises a grad's local piece too
        out[n] = (tuple(p.to_local().shape), ro.full_tensor(p).shape, ro.full_grad(p), ro.full_tensor(piece))
    return out


def test_full_grad_and_full_tensor_of_a_grad_give_the_full_gradient():
    ref = make_model()
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    got = run_on_ranks(_gathered, 3)
    for rank_out in got:
        for n, (local_shape, full_shape, grad, grad_via_full_tensor) in rank_out.items():
            assert len(local_shape) == 1 and full_shape == shapes[n], n
            assert grad.shape == shapes[n] and grad_via_full_tensor.shape == shapes[n], n
            assert torch.equal(grad, grad_via_full_tensor), n  # the same gather of the same pieces
    # every rank gets the same full gradient
    for rank_out in got[1:]:
        for n in rank_out:
            assert torch.equal(rank_out[n][2], got[0][n][2]), n


def test_full_grad_on_plain_params():
    p = torch.nn.Parameter(torch.ones(3, 2))
    assert ro.full_grad(p) is None
    p.grad = torch.full((3, 2), 2.0)
    assert torch.equal(ro.full_grad(p), p.grad)
    assert torch.equal(ro.full_tensor(p.grad), p.grad)
