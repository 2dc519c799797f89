"""memtrain.kernels.replayed_on_fake: on fake tensors (the estimate) a torch fallback runs once
per shape and options, and later calls replay its allocations and frees, one op each. Held here
against an independent count of what the tracker would see, for quantize's and the 1-bit mask's
torch paths; tests/test_estimate.py holds a whole estimate to the one the ops give."""

import memtrain.kernels as kernels
import pytest
import torch
from memtrain.kernels import bitmask, quant
from torch._subclasses.fake_tensor import FakeTensorMode

# make test-compat runs this file on the oldest torch: fake tensors' storages and dispatch
pytestmark = pytest.mark.compat


def _allocations(fn, *given):
    """fn()'s output, what it allocated and freed, in order, as a tracker sees it (("a", bytes)
    for a new storage, not one of the tensors `given`; ("f", i) when the i-th of them died: an
    independent count of kernels._record's), and how many ops it dispatched."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen, log, refs, ops = {t.untyped_storage()._cdata for t in given}, [], [], [0]

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += 1
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
                    st = t.untyped_storage()
                    seen.add(st._cdata)
                    i = len(refs)
                    log.append(("a", st.nbytes()))
                    refs.append(weakref.ref(st, lambda _, i=i, c=st._cdata: (
                        log.append(("f", i)), seen.discard(c))))
            return out

    with Log():
        out = fn()
    return out, list(log), ops[0]


@pytest.mark.parametrize("case", ["plain", "channels", "bf16", "strided", "noise", "partial"])
@pytest.mark.parametrize("bits", quant.BITS)
def test_on_fake_tensors_a_replay_allocates_what_the_torch_path_does(case, bits):
    """Quantize and dequantize: the same bytes, freed in the same order, the same output, in one
    op per allocation."""
    kernels._traces.clear()
    chan = (8, 25) if case == "channels" else None
    with FakeTensorMode():
        x = torch.randn(4, 8, 5, 5, dtype=torch.bfloat16 if case == "bf16" else torch.float32)
        if case == "strided":
            x = x.transpose(1, 3)
        if case == "partial":
            x = x[:, :, :3]
        noise = torch.rand(x.shape) if case == "noise" else None

        def pack():
            return quant.quantize_torch(x, bits, 64, case == "noise", noise=noise, chan=chan)

        given = [x] if noise is None else [x, noise]
        (buf, ran, ops), (again, replayed, few) = (_allocations(pack, *given) for _ in "12")
        assert replayed == ran and few == sum(e[0] == "a" for e in ran) < ops
        assert (again.shape, again.dtype) == (buf.shape, buf.dtype)

        def unpack():
            return quant.dequantize_torch(buf, x.numel(), bits, 64, x.dtype, chan=chan)

        (flat, ran, ops), (again, replayed, few) = (_allocations(unpack, buf) for _ in "12")
        assert replayed == ran and few == sum(e[0] == "a" for e in ran) < ops
        assert (again.shape, again.dtype) == (flat.shape, flat.dtype) == ((x.numel(),), x.dtype)
    assert len(kernels._traces) == 2 and all(t is not None for t in kernels._traces.values())


@pytest.mark.parametrize("shape", [(4, 8, 5, 5), (3, 7), (2, 3, 4)])
def test_on_fake_tensors_a_replay_allocates_what_the_mask_path_does(shape):
    """The 1-bit mask's pack and its masked gradient, alike (its unpack returns a view: it
    runs its ops every time)."""
    kernels._traces.clear()
    with FakeTensorMode():
        x = torch.randn(shape)
        (bits, ran, ops), (again, replayed, few) = (
            _allocations(lambda: bitmask.pack_torch(x), x) for _ in "12")
        assert replayed == ran and few == sum(e[0] == "a" for e in ran) < ops
        assert (again.shape, again.dtype) == (bits.shape, bits.dtype) == (
            (bitmask.n_bytes(x.numel()),), torch.uint8)
        (grad, ran, ops), (again, replayed, few) = (
            _allocations(lambda: bitmask.masked_grad_torch(x, bits), x, bits) for _ in "12")
        assert replayed == ran and few == sum(e[0] == "a" for e in ran) < ops
        assert (again.shape, again.dtype) == (grad.shape, grad.dtype) == (x.shape, x.dtype)
    assert len(kernels._traces) == 2 and all(t is not None for t in kernels._traces.values())
