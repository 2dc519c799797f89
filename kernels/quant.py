"""Low-bit group quantization of saved activations (method quantize; ActNN, GACT).

Format. A tensor of n elements, read in memory order, is cut into groups of G elements (the last
one zero-padded). Per group: mn = min, rng = max - mn, scale = rng / L with L = 2^bits - 1, and
each element's code q = floor((x - mn) * inv + u) clamped to [0, L], where inv = L / rng (0 for a
constant group) and u is uniform in [0, 1) (stochastic rounding: E[q * scale + mn] = x) or 0.5
(nearest). Codes are packed 8 / bits to a byte, element j of a byte at bit j * bits (little
order, as kernels/bitmask.py); padding codes are 0.

Channels (optional, `chan=(C, inner)`: the flat tensor is [outer, C, inner] in memory order).
Before grouping, every channel is shifted and scaled to [0, 1] by its own min and range over
the whole tensor: x' = (x - cmin[c]) * cinv[c], cinv = 1 / crng (0 for a constant channel), c =
(i // inner) % C; the groups quantize x', and dequantization returns (q * scale + mn) * crng[c] +
cmin[c]. A group that straddles channels (an NCHW map smaller than a group) then never gives a
channel of small range a step set by its neighbours' large range: every channel's step is at
most its own range / L. The map is deterministic and affine, so stochastic rounding stays
unbiased. Everything lives in one uint8 buffer:
`[codes: ngroups * G * bits / 8 | mn: ngroups fp32 | scale: ngroups fp32 | cmin: C fp32 |
crng: C fp32]` (C = 0 without channels), so a saved-tensor hook can hand a single tensor on (to
an offloader, to the accounting).

Three implementations of `quantize(x, ...) -> buffer` and `dequantize(buffer, n, ...) -> flat x`:
- Triton kernels (`_quant_pack_kernel`: min/max, rounding and packing fused, one program per
  group; `_unpack_dequant_kernel`): CUDA, or the CPU under TRITON_INTERPRET=1 (tests);
- vectorised torch (`quantize_torch`, `dequantize_torch`), any device, ~1/16 of the groups at
  a time so its fp32 temporaries stay a fraction of the tensor (not the activation peak);
- the eager oracle in kernels/reference.py (section quantize).
`quantize` / `dequantize` pick Triton on CUDA, torch elsewhere. The noise of stochastic rounding
comes from torch's generator (torch path, or `noise=` for tests) or from `tl.rand(seed, index)`
with a seed drawn from torch's generator (Triton), so `torch.manual_seed` fixes both.
"""

from __future__ import annotations

import functools

import torch
from memtrain.kernels import chunk_starts, is_fake, replayed_on_fake, triton_available

BITS = (2, 4, 8)
GROUP_MULTIPLE = 32  # group sizes are multiples of this: a group's codes fill whole 32-bit words
CHUNK_ELEMS = 1 << 20  # torch path: at most ~1M elements at a time ...
CHUNKS = 16  # ... and at most 1/16 of the tensor, so its temporaries never set the act. peak

triton = tl = None  # module globals bound on first use (the kernels resolve `tl` through them)


def buffer_bytes(n: int, bits: int, group_size: int, channels: int = 0) -> int:
    """Bytes of the packed buffer of n elements (with `channels` per-channel min and range)."""
    groups = n_groups(n, group_size)
    return groups * group_size * bits // 8 + 8 * groups + 8 * channels


def n_groups(n: int, group_size: int) -> int:
    return -(-n // group_size)


def split(buf: torch.Tensor, n: int, bits: int, group_size: int):
    """Views of a buffer: codes (uint8), mn (fp32 [groups]) and scale (fp32 [groups])."""
    groups = n_groups(n, group_size)
    nb = groups * group_size * bits // 8  # a multiple of 4: the fp32 views stay aligned
    stats = buf[nb:].view(torch.float32)
    return buf[:nb], stats[:groups], stats[groups:2 * groups]


def split_channels(buf: torch.Tensor, n: int, bits: int, group_size: int, channels: int):
    """Views of a buffer's per-channel stats: cmin (fp32 [C]) and crng (fp32 [C])."""
    groups = n_groups(n, group_size)
    stats = buf[groups * group_size * bits // 8:].view(torch.float32)[2 * groups:]
    return stats[:channels], stats[channels:2 * channels]


def _channel_stats(x: torch.Tensor, buf: torch.Tensor, n: int, bits: int, group_size: int,
                   chan: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every channel's min and range over x (flat [outer, C, inner]) written into buf; returns
    (cmin, cinv, crng) with cinv = 1 / crng (0 for a constant channel), all fp32 [C]."""
    channels, inner = chan
    cmin, crng = split_channels(buf, n, bits, group_size, channels)
    view = x.reshape(-1, channels, inner)
    cmin.copy_(view.amin(dim=(0, 2)))  # a min of x's dtype is exact in fp32
    crng.copy_(view.amax(dim=(0, 2)).float() - cmin)
    cinv = _inverse(crng, 1)
    return cmin, cinv, crng


def _check_chan(n: int, chan: tuple[int, int] | None) -> None:
    if chan is not None and (chan[0] < 1 or chan[1] < 1 or n % (chan[0] * chan[1])):
        raise ValueError(f"chan={chan} does not divide {n} elements as [outer, C, inner]")


# ---------------------------------------------------------------- Triton kernels


@functools.cache
def _kernels():
    """The kernels, defined on first use as in kernels/bitmask.py (why: there)."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_pack_kernel(
        x_ptr,  # *T    input, n elements, contiguous
        codes_ptr,  # *u8  output, G * BITS / 8 bytes per group
        mn_ptr,  # *f32     output, one min per group
        scale_ptr,  # *f32  output, one scale per group
        noise_ptr,  # *f32  uniform noise, n elements (NOISE == 1), else unused
        cmin_ptr,  # *f32   per-channel min, C (CHAN), else unused
        cinv_ptr,  # *f32   per-channel 1 / range (0: constant channel), C (CHAN), else unused
        n,  # number of elements
        seed,  # Philox seed of tl.rand (NOISE == 2)
        inner,  # elements per channel run: channel of element i = (i // inner) % C
        C,  # channels
        G: tl.constexpr,  # group size
        BITS: tl.constexpr,  # 2 | 4 | 8
        NOISE: tl.constexpr,  # 0 nearest | 1 noise from noise_ptr | 2 tl.rand
        CHAN: tl.constexpr,  # 1: scale every channel to [0, 1] before grouping
    ):
        PER: tl.constexpr = 8 // BITS  # codes per byte
        NB: tl.constexpr = G // PER  # bytes per group
        LEVELS: tl.constexpr = (1 << BITS) - 1
        pid = tl.program_id(0).to(tl.int64)
        byte = tl.arange(0, NB)  # [NB]
        slot = tl.arange(0, PER)  # [PER] code within a byte
        idx = pid * G + byte[:, None] * PER + slot[None, :]  # [NB, PER] element index
        inside = idx < n
        x = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        if CHAN:
            c = (idx // inner) % C
            x = (x - tl.load(cmin_ptr + c, mask=inside, other=0.0)) * \
                tl.load(cinv_ptr + c, mask=inside, other=0.0)
        mn = tl.min(tl.min(tl.where(inside, x, float("inf")), axis=1), axis=0)
        mx = tl.max(tl.max(tl.where(inside, x, float("-inf")), axis=1), axis=0)
        rng = mx - mn
        inv = tl.where(rng > 0, LEVELS / tl.where(rng > 0, rng, 1.0), 0.0)  # no 0 division
        if NOISE == 1:
            u = tl.load(noise_ptr + idx, mask=inside, other=0.0)
        elif NOISE == 2:
            u = tl.rand(seed, idx.to(tl.int32))  # wraps past 2^31 elements: still uniform
        else:
            u = tl.full(idx.shape, 0.5, tl.float32)
        q = tl.floor((x - mn) * inv + u)
        q = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)
        q = tl.where(inside, q, 0)
        packed = tl.sum(q << (slot[None, :] * BITS), axis=1)  # codes never overlap: sum == or
        tl.store(codes_ptr + pid * NB + byte, packed.to(tl.uint8))
        tl.store(mn_ptr + pid, mn)
        tl.store(scale_ptr + pid, rng / LEVELS)

    @triton.jit
    def _unpack_dequant_kernel(
        codes_ptr,  # *u8   packed codes (from _quant_pack_kernel)
        mn_ptr,  # *f32     min per group
        scale_ptr,  # *f32  scale per group
        cmin_ptr,  # *f32   per-channel min, C (CHAN), else unused
        crng_ptr,  # *f32   per-channel range, C (CHAN), else unused
        out_ptr,  # *T      output, n elements, contiguous
        n,  # number of elements
        inner,  # elements per channel run (CHAN)
        C,  # channels (CHAN)
        G: tl.constexpr,  # group size
        BITS: tl.constexpr,  # 2 | 4 | 8
        CHAN: tl.constexpr,  # 1: undo the per-channel scaling
    ):
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = G // PER
        pid = tl.program_id(0).to(tl.int64)
        byte = tl.arange(0, NB)
        slot = tl.arange(0, PER)
        idx = pid * G + byte[:, None] * PER + slot[None, :]
        packed = tl.load(codes_ptr + pid * NB + byte).to(tl.int32)
        q = (packed[:, None] >> (slot[None, :] * BITS)) & ((1 << BITS) - 1)
        x = q.to(tl.float32) * tl.load(scale_ptr + pid) + tl.load(mn_ptr + pid)
        if CHAN:
            inside = idx < n
            c = (idx // inner) % C
            x = x * tl.load(crng_ptr + c, mask=inside, other=0.0) + \
                tl.load(cmin_ptr + c, mask=inside, other=0.0)
        tl.store(out_ptr + idx, x.to(out_ptr.dtype.element_ty), mask=idx < n)

    return _quant_pack_kernel, _unpack_dequant_kernel


def quantize_triton(x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                    noise: torch.Tensor | None = None,
                    chan: tuple[int, int] | None = None) -> torch.Tensor:
    """The packed buffer of x (read flat, contiguous) by the fused Triton kernel. Stochastic
    rounding draws from `tl.rand` unless `noise` (fp32, x's numel) is given (tests). `chan`:
    (C, inner), per-channel scaling (module docstring)."""
    x = x.contiguous()
    n = x.numel()
    _check_chan(n, chan)
    buf = torch.empty(buffer_bytes(n, bits, group_size, chan[0] if chan else 0),
                      dtype=torch.uint8, device=x.device)
    if n == 0:
        return buf
    codes, mn, scale = split(buf, n, bits, group_size)
    cmin = cinv = mn  # unused without channels
    if chan is not None:
        cmin, cinv, _ = _channel_stats(x, buf, n, bits, group_size, chan)
    inner, channels = (chan[1], chan[0]) if chan else (1, 1)
    mode, seed = 0, 0
    if stochastic:
        mode = 1 if noise is not None else 2
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))
    quant_kernel, _ = _kernels()
    noise_arg = noise.contiguous() if noise is not None else mn
    quant_kernel[(n_groups(n, group_size),)](x, codes, mn, scale, noise_arg, cmin, cinv, n,
                                             seed, inner, channels, G=group_size, BITS=bits,
                                             NOISE=mode, CHAN=int(chan is not None))
    return buf


def dequantize_triton(buf: torch.Tensor, n: int, bits: int, group_size: int,
                      dtype: torch.dtype, chan: tuple[int, int] | None = None) -> torch.Tensor:
    """The n dequantized elements (flat, `dtype`) of a buffer, by the Triton kernel."""
    _check_chan(n, chan)
    out = torch.empty(n, dtype=dtype, device=buf.device)
    if n:
        codes, mn, scale = split(buf, n, bits, group_size)
        cmin = crng = mn  # unused without channels
        if chan is not None:
            cmin, crng = split_channels(buf, n, bits, group_size, chan[0])
        inner, channels = (chan[1], chan[0]) if chan else (1, 1)
        _, dequant_kernel = _kernels()
        dequant_kernel[(n_groups(n, group_size),)](codes, mn, scale, cmin, crng, out, n, inner,
                                                   channels, G=group_size, BITS=bits,
                                                   CHAN=int(chan is not None))
    return out


# ---------------------------------------------------------------- torch fallback


def _groups_per_chunk(n: int, group_size: int) -> int:
    """Groups per chunk: ~1/CHUNKS of the tensor, at most CHUNK_ELEMS elements, at least one."""
    return max(1, min(CHUNK_ELEMS, -(-n // CHUNKS)) // group_size)


def _channel_of(lo: int, count: int, chan: tuple[int, int], device) -> torch.Tensor:
    """The channel index of elements lo .. lo + count - 1 (int64)."""
    return torch.arange(lo, lo + count, device=device).floor_divide_(chan[1]).remainder_(chan[0])


@replayed_on_fake(lambda x, bits, group_size, stochastic, noise=None, chan=None: (
    tuple(x.shape), x.stride(), x.dtype, bits, group_size, stochastic,
    None if noise is None else (tuple(noise.shape), noise.stride(), noise.dtype), chan))
def quantize_torch(x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                   noise: torch.Tensor | None = None,
                   chan: tuple[int, int] | None = None) -> torch.Tensor:
    """The packed buffer of x (read flat, contiguous) with vectorised torch ops, any device.
    Works a chunk of groups at a time (`_groups_per_chunk`): its fp32 temporaries stay small.
    `chan`: (C, inner), per-channel scaling (module docstring)."""
    flat = x.reshape(-1)  # a view when x is contiguous (callers pass memory-order views)
    n = flat.numel()
    _check_chan(n, chan)
    buf = torch.empty(buffer_bytes(n, bits, group_size, chan[0] if chan else 0),
                      dtype=torch.uint8, device=x.device)
    codes, mn, scale = split(buf, n, bits, group_size)
    if chan is not None:
        cmin, cinv, _ = _channel_stats(flat, buf, n, bits, group_size, chan)
    per, levels = 8 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)
    # without channels, every group's min and step at once (one value per group: small), so
    # that a chunk runs only its rounding and packing
    inv_all = _group_stats(flat, mn, scale, group_size, levels) if chan is None else None
    # every chunk's views from one split per tensor (each op is a dispatch: under the memory
    # tracker the dispatches, not the arithmetic, dominate a small chunk's time on the CPU)
    mn_col, rows = mn.view(-1, 1), codes.view(-1, group_size * bits // 8)
    inv_col = inv_all.view(-1, 1) if inv_all is not None else None
    step = _groups_per_chunk(n, group_size)
    parts, row_parts = flat.split(step * group_size), rows.split(step)
    lo_parts, inv_parts = (mn_col.split(step), inv_col.split(step)) if inv_col is not None \
        else (None, None)
    noise_parts = noise.reshape(-1).split(step * group_size) if noise is not None else None
    for g0 in chunk_starts(n_groups(n, group_size), step, is_fake(x)):
        i = g0 // step
        # a private fp32 copy (also for fp32 input: .float() would alias x), modified in place
        part = parts[i].to(torch.float32, copy=True)
        if chan is not None:
            c = _channel_of(g0 * group_size, part.numel(), chan, x.device)
            part.sub_(cmin[c]).mul_(cinv[c])
        groups = -(-part.numel() // group_size)
        pad = groups * group_size - part.numel()
        if pad:  # repeat the last element: min and max unchanged; its codes zeroed below
            part = torch.cat([part, part[-1:].expand(pad)])
        xg = part.view(groups, group_size)
        if inv_col is None:
            lo, hi = xg.aminmax(dim=1, keepdim=True)
            rng = hi - lo
            inv = _inverse(rng, levels)
            mn_col[g0:g0 + groups], scale[g0:g0 + groups] = lo, rng.view(-1) / levels
        else:
            lo, inv = lo_parts[i], inv_parts[i]
        v = xg.sub_(lo).mul_(inv)
        if stochastic and pad:
            real = v.numel() - pad  # the padding's codes are zeroed below: no noise needed
            u = noise_parts[i][:real].float() if noise is not None else \
                torch.rand(real, device=x.device)
            v.view(-1)[:real].add_(u)
        elif stochastic:  # the same draws, in the chunk's shape
            v.add_(noise_parts[i].view(v.shape).float() if noise is not None else
                   torch.rand(v.shape, device=x.device))
        else:
            v.add_(0.5)
        # v >= 0, so the cast's truncation is the floor: clamped first, one op fewer
        v.clamp_(0, levels)
        if pad:
            v.view(-1)[-pad:] = 0
        if per == 1:  # 8 bits: a code per byte, cast into the buffer (truncating, as .to does)
            row_parts[i].copy_(v)
        else:
            torch.sum(v.to(torch.uint8).view(groups, group_size // per, per) << shifts, -1,
                      dtype=torch.uint8, out=row_parts[i])
    return buf


def _inverse(rng: torch.Tensor, levels: int) -> torch.Tensor:
    """levels / rng per group (or channel), 0 where the range is 0."""
    return torch.where(rng > 0, levels / torch.where(rng > 0, rng, 1.0), 0.0)


def _group_stats(flat: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, group_size: int,
                 levels: int) -> torch.Tensor:
    """Every group's min (into `mn`) and step (into `scale`) of `flat` in its own dtype (a min
    or max is exact in fp32); returns levels / range per group (fp32). The last group's
    padding would repeat its last element: its min and max are those of its elements."""
    n = flat.numel()
    full = n // group_size
    hi = torch.empty_like(mn)
    if full:
        lo_f, hi_f = flat[:full * group_size].view(full, group_size).aminmax(dim=1)
        mn[:full], hi[:full] = lo_f, hi_f
    if n % group_size:
        lo_r, hi_r = flat[full * group_size:].aminmax()
        mn[full], hi[full] = lo_r, hi_r
    rng = hi.sub_(mn)
    scale.copy_(rng / levels)
    return _inverse(rng, levels)


@replayed_on_fake(lambda buf, n, bits, group_size, dtype, chan=None: (
    tuple(buf.shape), buf.stride(), buf.dtype, n, bits, group_size, dtype, chan))
def dequantize_torch(buf: torch.Tensor, n: int, bits: int, group_size: int,
                     dtype: torch.dtype, chan: tuple[int, int] | None = None) -> torch.Tensor:
    """The n dequantized elements (flat, `dtype`) of a buffer, vectorised torch, chunked."""
    _check_chan(n, chan)
    codes, mn, scale = split(buf, n, bits, group_size)
    if chan is not None:
        cmin, crng = split_channels(buf, n, bits, group_size, chan[0])
    out = torch.empty(n, dtype=dtype, device=buf.device)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=buf.device)
    mask = (1 << bits) - 1
    step = _groups_per_chunk(n, group_size)
    # the views a chunk slices, made once (quantize_torch: each op is a dispatch)
    rows = codes.view(-1, group_size * bits // 8, 1)
    scale_col, mn_col = scale.view(-1, 1), mn.view(-1, 1)
    for g0 in chunk_starts(rows.shape[0], step, is_fake(buf)):
        q = (rows[g0:g0 + step] >> shifts).bitwise_and_(mask)  # [groups, bytes, per]
        x = q.view(q.shape[0], group_size).float()
        x.mul_(scale_col[g0:g0 + step]).add_(mn_col[g0:g0 + step])
        lo = g0 * group_size
        x = x.view(-1)[:n - lo]
        if chan is not None:
            c = _channel_of(lo, x.numel(), chan, buf.device)
            x.mul_(crng[c]).add_(cmin[c])
        out[lo:lo + x.numel()] = x
    return out


# ---------------------------------------------------------------- dispatch


def _use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and triton_available()


def quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
             chan: tuple[int, int] | None = None) -> torch.Tensor:
    """Packed buffer of x read flat (x contiguous): Triton on CUDA, torch elsewhere."""
    fn = quantize_triton if _use_triton(x) else quantize_torch
    return fn(x, bits, group_size, stochastic, chan=chan)


def dequantize(buf: torch.Tensor, n: int, bits: int, group_size: int,
               dtype: torch.dtype, chan: tuple[int, int] | None = None) -> torch.Tensor:
    """The n elements (flat, `dtype`) held in a buffer: Triton on CUDA, torch elsewhere."""
    fn = dequantize_triton if _use_triton(buf) else dequantize_torch
    return fn(buf, n, bits, group_size, dtype, chan=chan)
