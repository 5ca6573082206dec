"""The all-reduce of a row-parallel projection at 1-16 tokens a step, inside the GEMV that makes the
partial sums: no launch of its own, no barrier, no fence.

Under tensor parallelism a decode step runs two all-reduces a layer. As a kernel of its own, an
all-reduce costs its launch, two barriers across the GPUs and, being torch's, a break in the
programmatic-dependent-launch chain (kernels/pdl.py) on both sides (scripts/push_bench.py).

Here each program of the GEMV, once it has its outputs, stores them to every rank (its own
included) as 8-byte words that carry two bf16/fp16 outputs and a sequence number (NCCL's LL
protocol: one store is atomic, so the number arriving means the data has arrived, and no fence,
flag or counter is needed), and leaves. The last program of each group of GROUP reads the group's
words from its own buffer until every rank's numbers match, adds the W partials in rank order in
fp32 (rounded once: the same bits on every rank) and stores the sum to y. Only those programs wait,
and only for programs that never wait; the others free their slots at once, where the next launch
(PDL) starts streaming its weights.

Buffers (graphrt/parallel/group.py makes them; data in symmetric memory): on each rank,
data [2, W, words] int64 (slot, source rank, word; a word is two adjacent outputs of one row) and
seq [words] int32, how many pushes have covered each word, the same count on every rank (they run
the same launches); the program that reads a word's sums advances it after its reads. The k-th
push over word w uses slot k % 2 and number k. A rank writes a slot's word again only at push
k + 2, inside a launch that began after its push k + 1 had read every rank's word k + 1, which each
peer wrote after its push k, the last reader of that slot, had finished (a launch's programs write
only after the wait for the launch before, under PDL too).

Several rows (push_reduce_tile: the GEMV's FMA path at two rows, its DOT path at 3-16) push the
same words, a tile's rows one after another; there every tile's program waits for its own tile's
words and advances their counts itself. The vocab-parallel embedding lookup of one token
(embedding_pushed) sums like a one-row product: the rank holding the token's row pushes it, the
others push zeros.

CUDA only (symmetric memory); the CPU and gloo all-reduce as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from graphrt.kernels.pdl import _INTERPRETED

__all__ = ["PushTarget", "push_reduce_row", "push_reduce_tile", "no_push_args", "embedding_pushed",
           "embedding_pushed_reference", "MAX_ROWS"]

MAX_ROWS = 16  # rows of a product the buffers take: the GEMV's DOT path (3-16 tokens)

GROUP = tl.constexpr(64)  # programs whose outputs one program adds up


@dataclass
class PushTarget:
    """One rank's view of the push buffers of a tensor-parallel group (see the module docstring)."""

    data: torch.Tensor  # [2, W, words] int64, this rank's (symmetric memory)
    table: torch.Tensor  # [W] int64: every rank's data address
    seq: torch.Tensor  # [words] int32
    rank: int
    world: int
    dtype: torch.dtype  # of the outputs: bf16 or fp16

    @property
    def words(self) -> int:
        return self.data.shape[-1]

    def fits(self, n: int, block_n: int, dtype: torch.dtype, rows: int = 1) -> bool:
        """Whether a product of rows x n outputs in dtype, block_n columns a program, can be summed
        here (two outputs a word)."""
        return (n % 2 == 0 and block_n % 2 == 0 and dtype == self.dtype and dtype.itemsize == 2
                and rows * -(-n // block_n) * block_n <= 2 * self.words)

    def kernel_args(self) -> tuple:
        """(table, seq, rank, words): the runtime arguments of a kernel that pushes."""
        return self.table, self.seq, self.rank, self.words


def no_push_args(x: torch.Tensor) -> tuple:
    """Placeholders for the push arguments of a kernel that does not push."""
    return x, x, 0, 0


@triton.jit
def _pack(vals, s):
    """[2H] outputs (16-bit) and [H] numbers -> [H] int64 words: number << 32 | out[2i+1] << 16 | out[2i]."""
    bits = vals.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo, hi = tl.split(tl.reshape(bits, [vals.shape[0] // 2, 2]))
    return (s.to(tl.int64) << 32) | (((hi << 16) | lo).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _unpack(words, dtype: tl.constexpr):
    """The inverse of _pack's data: [H] words -> [2H] outputs in dtype, as fp32."""
    lo = (words & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [words.shape[0] * 2]).to(tl.float32)


@triton.jit
def _store_word(ptrs, words, mask):
    """st.relaxed.sys of int64 words where mask: a strong store, so that a reader's volatile load
    sees each word whole (a weak store racing with it gives no such promise). Under the
    interpreter, a plain store."""
    if _INTERPRETED:
        tl.store(ptrs, words, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [ptrs.to(tl.int64, bitcast=True), words, mask.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)


@triton.jit
def _wait_word(ptrs, s, mask):
    """ptrs' int64 words once their numbers (high halves) read s, where mask (0 elsewhere). Each
    thread spins on its own words (volatile loads: L2, never a stale L1 line), so no
    reduction across the program decides when the wait is over."""
    if _INTERPRETED:
        got = tl.load(ptrs, mask=mask, other=0)
        while tl.max((((got >> 32).to(tl.int32) != s) & mask).to(tl.int32), axis=0) > 0:
            got = tl.load(ptrs, mask=mask, other=0)
    else:
        got = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 lo, hi; mov.b64 $0, 0; setp.eq.b32 p, $3, 0; @p bra DONE${:uid};\n"
            "LOOP${:uid}: ld.volatile.global.b64 $0, [$1]; mov.b64 {lo, hi}, $0; setp.ne.b32 p, hi, $2;\n"
            "@p bra LOOP${:uid};\nDONE${:uid}: }",
            "=l,l,r,r", [ptrs.to(tl.int64, bitcast=True), s, mask.to(tl.int32)], dtype=tl.int64,
            is_pure=False, pack=1)
    return got


@triton.jit
def _send(vals, w, ok, seq_ptr, tab_ptr, rank, words, W: tl.constexpr):
    """Store this rank's outputs vals [2H] (16-bit, pairs adjacent) as words w [H] (where ok) to
    every rank, its own included, each with its push number s (seq + 1: slot s % 2) -> s."""
    s = tl.load(seq_ptr + w, mask=ok, other=0, cache_modifier=".cg") + 1
    word = _pack(vals, s)
    for q in tl.static_range(W):
        base = tl.load(tab_ptr + q).to(tl.pointer_type(tl.int64))
        _store_word(base + ((s % 2) * W + rank) * words + w, word, ok)
    return s


@triton.jit
def _sum(w, ok, s, seq_ptr, tab_ptr, rank, words, W: tl.constexpr, dtype: tl.constexpr):
    """The [2H] fp32 sum over the W ranks of words w (where ok), read from this rank's buffer once
    every rank's carry their numbers s, added in rank order (every rank the same bits); then the
    words' counts advance to s."""
    mine = tl.load(tab_ptr + rank).to(tl.pointer_type(tl.int64))
    acc = tl.zeros([w.shape[0] * 2], tl.float32)
    for q in tl.static_range(W):
        acc += _unpack(_wait_word(mine + ((s % 2) * W + q) * words + w, s, ok), dtype)
    tl.store(seq_ptr + w, s, mask=ok)
    return acc


@triton.jit
def push_reduce_row(vals, pid, BLOCK_N: tl.constexpr, n, y_ptr, tab_ptr, seq_ptr, rank, words,
                    W: tl.constexpr):
    """The epilogue of program pid of a one-row product: vals [BLOCK_N] (y's dtype, BLOCK_N even)
    are outputs pid * BLOCK_N + arange(BLOCK_N) of this rank's partial (n even); y_ptr [n] gets
    their sum over the W ranks (the last program of each GROUP waits and adds). Call after the wait
    for the launch before (seq is settled then)."""
    HALF: tl.constexpr = BLOCK_N // 2
    w = pid * HALF + tl.arange(0, HALF)
    _send(vals, w, w * 2 < n, seq_ptr, tab_ptr, rank, words, W)
    group = pid // GROUP
    if pid == tl.minimum(group * GROUP + GROUP, tl.num_programs(0)) - 1:
        gw = group * (GROUP * HALF) + tl.arange(0, GROUP * HALF)
        gmask = gw * 2 < n
        gs = tl.load(seq_ptr + gw, mask=gmask, other=0, cache_modifier=".cg") + 1
        acc = _sum(gw, gmask, gs, seq_ptr, tab_ptr, rank, words, W, vals.dtype)
        offs = group * (GROUP * BLOCK_N) + tl.arange(0, GROUP * BLOCK_N)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def push_reduce_tile(vals, tile, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, n, y_ptr, stride_ym, tab_ptr,
                     seq_ptr, rank, words, W: tl.constexpr):
    """The epilogue of the program that holds output tile `tile` of an M-row product (the GEMV's
    FMA path at two rows, its DOT path at 3-16, unsplit or in the split-K reduction): vals
    [BLOCK_M, BLOCK_N] (y's dtype; rows past M and columns past n are never read) is this rank's
    partial of rows arange(BLOCK_M), columns tile * BLOCK_N + arange(BLOCK_N); y_ptr [M, n] (row
    stride stride_ym) gets their sum over the W ranks. Call after the wait for the launch before
    (seq is settled then). The tile's words are (tile * M + row) * BLOCK_N / 2 onward; every
    program waits, each only for its own tile's programs, which push before they wait."""
    HALF: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_M)[:, None]
    i = tl.arange(0, HALF)[None, :]
    w = tl.reshape((tile * M + r) * HALF + i, [BLOCK_M * HALF])  # row-major, as the words pack
    ok = tl.reshape((r < M) & (tile * BLOCK_N + 2 * i < n), [BLOCK_M * HALF])
    s = _send(tl.reshape(vals, [BLOCK_M * BLOCK_N]), w, ok, seq_ptr, tab_ptr, rank, words, W)
    acc = _sum(w, ok, s, seq_ptr, tab_ptr, rank, words, W, vals.dtype)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(y_ptr + r.to(tl.int64) * stride_ym + cols, tl.reshape(acc, [BLOCK_M, BLOCK_N]).to(y_ptr.dtype.element_ty),
             mask=(r < M) & (cols < n))


_EMBED_BLOCK = 8  # outputs per program of the embedding lookup: a group's sum is 512 outputs


@triton.jit
def _embedding_push_kernel(tok_ptr, table_ptr, y_ptr, vocab_start, rows, H, tab_ptr, seq_ptr, rank, words,
                           BLOCK_N: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    local = tl.load(tok_ptr).to(tl.int64) - vocab_start + offs * 0  # a tensor: the interpreter takes no scalar mask
    vals = tl.load(table_ptr + local * H + offs, mask=(offs < H) & (local >= 0) & (local < rows), other=0.0)
    push_reduce_row(vals, pid, BLOCK_N, H, y_ptr, tab_ptr, seq_ptr, rank, words, W)


def embedding_pushed_reference(tokens: torch.Tensor, table: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """This rank's part of a vocab-parallel lookup: its rows where it holds the token, zeros
    elsewhere; summed over the ranks (an all-reduce) that is the lookup in the whole table."""
    local = tokens - vocab_start
    mine = (local >= 0) & (local < table.shape[0])
    return torch.nn.functional.embedding(local.clamp(0, table.shape[0] - 1), table).masked_fill(~mine[:, None], 0)


def embedding_pushed(tokens: torch.Tensor, table: torch.Tensor, vocab_start: int,
                     push: PushTarget | None) -> torch.Tensor | None:
    """tokens [1] int64, table [rows, H] (this rank's vocab shard, rows vocab_start onward; bf16/fp16,
    contiguous) -> [1, H]: the token's row of the whole table, summed over the group in one launch
    (embedding_pushed_reference on every rank, then the all-reduce). None where the push does not
    take it (no push buffers, more than one token, another dtype or width): the caller all-reduces.
    Launched without PDL, so that like the torch lookup it replaces it starts after everything
    before it has finished (kernels/pdl.py, "Settled memory")."""
    if (push is None or tokens.numel() != 1 or not table.is_contiguous()
            or not push.fits(table.shape[1], _EMBED_BLOCK, table.dtype)):
        return None
    h = table.shape[1]
    y = torch.empty(1, h, dtype=table.dtype, device=table.device)
    _embedding_push_kernel[(triton.cdiv(h, _EMBED_BLOCK),)](
        tokens, table, y, vocab_start, table.shape[0], h, *push.kernel_args(), BLOCK_N=_EMBED_BLOCK, W=push.world)
    return y
