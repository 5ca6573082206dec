"""Counter-based RNG with identical bits in PyTorch and Triton.

Every random number graphrt draws is a pure function of (seed, position[, vocab index]), never of
global state, so a seeded request samples the same tokens whatever else is in its batch, whatever
its slot, eager or graph replay.

Definition (all arithmetic on uint32, wrapping):

    mix(x)            = lowbias32: x ^= x>>16; x *= 0x7FEB352D; x ^= x>>15; x *= 0x846CA68B; x ^= x>>16
    row_key(s, p)     = mix(mix(mix(s_lo ^ 0x9E3779B9) ^ s_hi) ^ mix(p_lo ^ 0x85EBCA6B))
    accept_bits(s, p) = mix(row_key ^ 0x68E31DA4)
    race_bits(s,p,v)  = mix(mix(row_key ^ 0x1B56C4E9) ^ (v * 0x9E3779B1))
    chunk_bits(s,p,c) = mix(mix(row_key ^ 0x2C1B3C6D) ^ (c * 0x9E3779B1))   (c: vocab chunk)
    uniform(h)        = ((h >> 9) + 0.5) * 2**-23      (fp32, exact, in [2**-24, 1 - 2**-24])
    gumbel(h)         = -log(-log(uniform(h)))

s_lo/s_hi are the low/high 32-bit words of the int64 seed, p_lo the low word of the int64 position.
Why 23 bits and not 24: (m + 0.5) * 2**-24 for a 24-bit m needs 25 significand bits and rounds to
exactly 1.0 at the top (then -log(-log u) = +inf); with 23 bits every value is exact and < 1.

The torch side works on int64 tensors holding values in [0, 2**32): a 32x32-bit product does not
fit in int64, so `_mul32` multiplies by 16-bit halves. The Triton side works on tl.uint32, whose
`>>` is a logical shift and whose multiply wraps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK32 = 0xFFFFFFFF
SEED_SALT = 0x9E3779B9
POS_SALT = 0x85EBCA6B
ACCEPT_STREAM = 0x68E31DA4
RACE_STREAM = 0x1B56C4E9
CHUNK_STREAM = 0x2C1B3C6D
VOCAB_MULT = 0x9E3779B1
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
# 1 - 2**-24: subtracting it from a float in [1, 2) built from 23 random mantissa bits gives
# ((h >> 9) + 0.5) * 2**-23 exactly (Sterbenz), without an int-to-float conversion.
_ONE_MINUS_HALF_ULP = 1.0 - 2.0**-24
# Triton kernels may only read globals that are constexpr.
_TL_MASK32 = tl.constexpr(MASK32)
_TL_SEED_SALT = tl.constexpr(SEED_SALT)
_TL_POS_SALT = tl.constexpr(POS_SALT)
_TL_ACCEPT_STREAM = tl.constexpr(ACCEPT_STREAM)
_TL_RACE_STREAM = tl.constexpr(RACE_STREAM)
_TL_CHUNK_STREAM = tl.constexpr(CHUNK_STREAM)
_TL_VOCAB_MULT = tl.constexpr(VOCAB_MULT)
_TL_MIX_MUL1 = tl.constexpr(MIX_MUL1)
_TL_MIX_MUL2 = tl.constexpr(MIX_MUL2)
_TL_ONE_MINUS_HALF_ULP = tl.constexpr(_ONE_MINUS_HALF_ULP)
# Largest Gumbel value uniform() can produce: -log(-log(1 - 2**-24)) ~= 16.64; callers may use it
# to bound a race key from above.
GUMBEL_MAX = 16.7


# ---------------------------------------------------------------------------------------------
# PyTorch reference (int64 tensors holding uint32 values)
# ---------------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 without overflowing int64: split x into 16-bit halves.
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def row_key(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Per-(seed, position) key. seed, position: broadcastable int64 tensors -> int64 in [0, 2**32)."""
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    s_lo = seed & MASK32
    s_hi = (seed >> 32) & MASK32
    skey = mix32(mix32(s_lo ^ SEED_SALT) ^ s_hi)
    return mix32(skey ^ mix32((position & MASK32) ^ POS_SALT))


def race_bits(seed: torch.Tensor, position: torch.Tensor, vocab: torch.Tensor,
              stream: int = RACE_STREAM) -> torch.Tensor:
    """seed, position: [...]; vocab: [V] -> [..., V] hashes for the Gumbel race (stream
    CHUNK_STREAM: indices are vocab chunks, for the race between chunks)."""
    rkey = mix32(row_key(seed, position) ^ stream)
    v = _mul32(vocab.to(torch.int64), VOCAB_MULT)
    return mix32(rkey.unsqueeze(-1) ^ v)


def bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def accept_uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) used to accept the draft at (seed, position). Shapes broadcast -> fp32."""
    return bits_to_uniform(mix32(row_key(seed, position) ^ ACCEPT_STREAM))


def race_gumbel(seed: torch.Tensor, position: torch.Tensor, vocab_size: int,
                stream: int = RACE_STREAM) -> torch.Tensor:
    """Gumbel noise g(seed, position, v) for v in [0, V): [...] -> [..., V] fp32."""
    vocab = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    u = bits_to_uniform(race_bits(seed, position, vocab, stream))
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------------------------------------
# Triton device functions: the same math on tl.uint32
# ---------------------------------------------------------------------------------------------


@triton.jit
def tl_mix32(x):
    x = x ^ (x >> 16)
    x = x * _TL_MIX_MUL1
    x = x ^ (x >> 15)
    x = x * _TL_MIX_MUL2
    return x ^ (x >> 16)


@triton.jit
def tl_row_key(seed, position):
    """seed, position: int64 scalars or tensors -> uint32 key."""
    seed = seed.to(tl.int64)
    position = position.to(tl.int64)
    s_lo = (seed & _TL_MASK32).to(tl.uint32)
    s_hi = ((seed >> 32) & _TL_MASK32).to(tl.uint32)
    p_lo = (position & _TL_MASK32).to(tl.uint32)
    skey = tl_mix32(tl_mix32(s_lo ^ _TL_SEED_SALT) ^ s_hi)
    return tl_mix32(skey ^ tl_mix32(p_lo ^ _TL_POS_SALT))


@triton.jit
def tl_bits_to_uniform(h):
    one_to_two = ((h >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
    return one_to_two - _TL_ONE_MINUS_HALF_ULP


@triton.jit
def tl_accept_uniform(seed, position):
    return tl_bits_to_uniform(tl_mix32(tl_row_key(seed, position) ^ _TL_ACCEPT_STREAM))


@triton.jit
def tl_race_key(seed, position):
    """Per-row key of the Gumbel race; compute once per row, then call tl_race_bits per element."""
    return tl_mix32(tl_row_key(seed, position) ^ _TL_RACE_STREAM)


@triton.jit
def tl_chunk_key(seed, position):
    """Per-row key of the race between vocab chunks; pass it to tl_race_bits with chunk indices."""
    return tl_mix32(tl_row_key(seed, position) ^ _TL_CHUNK_STREAM)


@triton.jit
def tl_race_bits(rkey, vocab):
    """rkey: uint32 from tl_race_key; vocab: int32/int64 indices -> uint32 hashes."""
    return tl_mix32(rkey ^ (vocab.to(tl.uint32) * _TL_VOCAB_MULT))


@triton.jit
def tl_gumbel(u):
    """gumbel(u) for u from tl_bits_to_uniform: the same two logs as the torch side."""
    return -tl.log(-tl.log(u))


@triton.jit
def tl_race_gumbel(rkey, vocab):
    return tl_gumbel(tl_bits_to_uniform(tl_race_bits(rkey, vocab)))


@triton.jit
def tl_gumbel_upper_bound(u, FAST: tl.constexpr):
    """A float >= tl_gumbel(u), for skipping race entries that cannot win.

    -log u >= 1 - u on (0, 1), so g = -log(-log u) <= -log(1 - u) as real numbers; 1 - u is exact
    for every uniform() value, and the 1e-3 margin covers the logs' errors on both sides (a few
    ulps of |g| <= 16.7; lg2.approx is within ~1e-6 here). FAST: one MUFU lg2 (CUDA only).
    """
    w = 1.0 - u
    if FAST:
        l2 = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [w], dtype=tl.float32,
                                       is_pure=True, pack=1)
    else:
        l2 = tl.log2(w)
    return l2 * -0.6931471805599453 + 1e-3
