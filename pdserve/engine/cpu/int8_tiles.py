"""The int8 product's register tiles, written in LLVM IR as numba intrinsics (cpu/int8.py).

Both tiles multiply int16 activations by int8 weights and sum the products in adjacent pairs into
int32 lanes: sign-extended ``<16 x i16>`` operands, a ``<16 x i32>`` product, its even and odd
lanes added. That is the shape of x86's ``pmaddwd`` (AVX2: 16 products per instruction, FMA does
8) and of VNNI's ``vpdpwssd``, so LLVM selects them where the CPU has them; the IR names no
instruction, so any CPU LLVM targets compiles it and no feature check is needed (the int8
product's self-test checks the result).

* :func:`dot_tile` (few rows: a decode step) reads each output channel's int8 row (``[n, k]``
  weights): per 16-element step one activation vector per row and one weight vector per channel,
  one accumulator per (row, channel), reduced across its lanes at the end. Each weight byte is read
  once per tile, which is what a bandwidth-bound step needs, but every output pays a reduction.
* :func:`broadcast_tile` (many rows: a prefill) reads weights packed in blocks of 8 channels
  (``[n / 8, k / 2, 8, 2]``, :func:`cpu.int8.pack_blocks`): per pair of ``k`` one weight vector per
  block (8 channels x 2) and one row's activation pair broadcast to all lanes, so each accumulator
  holds 8 channels' sums and nothing is reduced; a row's 8 outputs come out of one vector. Fewer
  instructions per product than the dot tile where the product is compute-bound (Zen 3, AVX2, one
  thread, 512 rows at SmolLM2's shapes: 1.25-1.4x MKL's packed float32 GEMM; the dot tile 1.0-1.1x).
"""

from __future__ import annotations

from typing import Any

STEP = 16  # int16 products per vector step of a dot tile (the rest of k: a scalar loop)
PREFETCH = 2  # dot tiles ahead whose weights a dot tile prefetches
LANES = 8  # output channels per weight block of the broadcast tile (one <8 x i32> accumulator)


def dot_tile(rows: int, cols: int, out_cols: int) -> Any:  # pragma: no cover - runs in numba's compiler
    """A numba intrinsic ``tile(x, xs, w, ws, steps, out)`` (addresses and strides as integers):
    ``out[a * out_cols + b] = sum(x[a, i] * w[b, i] for i < 16 steps)`` in int32 for ``rows`` rows
    of int16 ``x`` (row stride ``xs`` elements) and ``cols`` channels of int8 ``w`` (row stride ``ws``
    bytes). Per step one <16 x i16> load per row, one <16 x i8> per channel (sign-extended), and per
    pair the products summed in adjacent pairs into <8 x i32> accumulators; the accumulators are
    reduced at the end."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile(typingctx: Any, x: Any, xs: Any, w: Any, ws: Any, steps: Any, out: Any) -> Any:
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            x, xs, w, ws, steps, out = args
            i64, i32, i16, i8 = ir.IntType(64), ir.IntType(32), ir.IntType(16), ir.IntType(8)
            v16i16, v16i8, v16i32 = (
                ir.VectorType(i16, STEP),
                ir.VectorType(i8, STEP),
                ir.VectorType(i32, STEP),
            )
            v8i32 = ir.VectorType(i32, STEP // 2)
            zero = ir.Constant(v8i32, None)
            entry, loop, done = _loop_blocks(builder, steps, "i8tile")
            i = builder.phi(i64)
            accs = [builder.phi(v8i32) for _ in range(rows * cols)]
            # The weights of the tile PREFETCH tiles ahead, cols * 16 bytes per step (a group's channel
            # rows are contiguous): the tile reads its channels side by side, streams too short for
            # the hardware prefetcher to follow (a single row read ~40 % slower from DRAM without).
            ahead = builder.add(
                builder.add(w, builder.mul(ir.Constant(i64, PREFETCH * cols), ws)),
                builder.mul(i, ir.Constant(i64, STEP * cols)),
            )
            _prefetch(builder, ahead)
            wide = []
            for c in range(cols):
                at = builder.add(
                    w,
                    builder.add(builder.mul(ir.Constant(i64, c), ws), builder.mul(i, ir.Constant(i64, STEP))),
                )
                v = builder.load(builder.inttoptr(at, v16i8.as_pointer()), align=1)
                wide.append(builder.sext(builder.sext(v, v16i16), v16i32))
            new = []
            for r in range(rows):
                at = builder.add(
                    x,
                    builder.add(
                        builder.mul(ir.Constant(i64, 2 * r), xs), builder.mul(i, ir.Constant(i64, 2 * STEP))
                    ),
                )
                xv = builder.sext(builder.load(builder.inttoptr(at, v16i16.as_pointer()), align=2), v16i32)
                for c in range(cols):
                    new.append(builder.add(accs[r * cols + c], _pair_sums(builder, xv, wide[c])))
            finals = _close_loop(builder, i, steps, entry, loop, done, accs, new, zero)
            name = "llvm.vector.reduce.add.v8i32"
            reduce = builder.module.globals.get(name) or ir.Function(
                builder.module, ir.FunctionType(i32, [v8i32]), name
            )
            for r in range(rows):
                for c in range(cols):
                    at = builder.add(out, ir.Constant(i64, 4 * (r * out_cols + c)))
                    builder.store(
                        builder.call(reduce, [finals[r * cols + c]]),
                        builder.inttoptr(at, i32.as_pointer()),
                        align=4,
                    )
            return context.get_dummy_value()

        return sig, codegen

    return tile


def broadcast_tile(rows: int, cols: int, out_width: int) -> Any:  # pragma: no cover - numba's compiler
    """A numba intrinsic ``tile(x, xs, w, ws, pairs, out)``: ``out[a * out_width + 8 b + l] =
    sum(x[a, i] * W[8 b + l, i] for i < 2 pairs)`` in int32 for ``rows`` rows of int16 ``x`` (row
    stride ``xs`` elements) and ``cols`` blocks of 8 channels of packed int8 weights (block ``b`` at
    ``w + b * ws``, holding ``[pairs, 8, 2]``). Per pair of ``k`` one <16 x i8> load per block
    (sign-extended) and per row one i16 pair broadcast to all lanes; no reduction at the end."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile(typingctx: Any, x: Any, xs: Any, w: Any, ws: Any, pairs: Any, out: Any) -> Any:
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            x, xs, w, ws, pairs, out = args
            i64, i32, i16, i8 = ir.IntType(64), ir.IntType(32), ir.IntType(16), ir.IntType(8)
            width = 2 * LANES
            v16i8, v16i16, v16i32 = (
                ir.VectorType(i8, width),
                ir.VectorType(i16, width),
                ir.VectorType(i32, width),
            )
            v8i32, v2i16 = ir.VectorType(i32, LANES), ir.VectorType(i16, 2)
            splat = ir.Constant(v16i32, [t % 2 for t in range(width)])  # x[2t], x[2t+1] in every lane pair
            zero = ir.Constant(v8i32, None)
            entry, loop, done = _loop_blocks(builder, pairs, "i8bcast")
            t = builder.phi(i64)
            accs = [builder.phi(v8i32) for _ in range(rows * cols)]
            blocks = []
            for c in range(cols):
                at = builder.add(
                    w,
                    builder.add(
                        builder.mul(ir.Constant(i64, c), ws), builder.mul(t, ir.Constant(i64, width))
                    ),
                )
                v = builder.load(builder.inttoptr(at, v16i8.as_pointer()), align=1)
                blocks.append(builder.sext(builder.sext(v, v16i16), v16i32))
            new = []
            for r in range(rows):
                at = builder.add(
                    x,
                    builder.add(
                        builder.mul(ir.Constant(i64, 2 * r), xs), builder.mul(t, ir.Constant(i64, 4))
                    ),
                )
                pair = builder.load(builder.inttoptr(at, v2i16.as_pointer()), align=2)
                xv = builder.sext(builder.shuffle_vector(pair, pair, splat), v16i32)
                for c in range(cols):
                    new.append(builder.add(accs[r * cols + c], _pair_sums(builder, xv, blocks[c])))
            finals = _close_loop(builder, t, pairs, entry, loop, done, accs, new, zero)
            for r in range(rows):
                for c in range(cols):
                    at = builder.add(out, ir.Constant(i64, 4 * (r * out_width + LANES * c)))
                    builder.store(finals[r * cols + c], builder.inttoptr(at, v8i32.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _loop_blocks(builder: Any, count: Any, name: str) -> tuple[Any, Any, Any]:
    """Branch into a counted loop's body when ``count`` > 0; the builder is left at the body."""
    from llvmlite import ir

    entry = builder.basic_block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(ir.IntType(64), 0)), loop, done)
    builder.position_at_end(loop)
    return entry, loop, done


def _close_loop(
    builder: Any, i: Any, count: Any, entry: Any, loop: Any, done: Any, accs: list, new: list, zero: Any
) -> list:
    """End the loop body (``i`` counts to ``count``), wire the phis, and return the accumulators'
    final values (zero when the loop did not run), the builder left after the loop."""
    from llvmlite import ir

    i64 = ir.IntType(64)
    nxt = builder.add(i, ir.Constant(i64, 1))
    builder.cbranch(builder.icmp_signed("<", nxt, count), loop, done)
    i.add_incoming(ir.Constant(i64, 0), entry)
    i.add_incoming(nxt, loop)
    for a, v in zip(accs, new, strict=True):
        a.add_incoming(zero, entry)
        a.add_incoming(v, loop)
    builder.position_at_end(done)
    finals = []
    for v in new:  # every phi before the first other instruction of the block
        f = builder.phi(v.type)
        f.add_incoming(zero, entry)
        f.add_incoming(v, loop)
        finals.append(f)
    return finals


def _pair_sums(builder: Any, a: Any, b: Any) -> Any:
    """``a * b`` (<16 x i32>) with adjacent lanes summed: <8 x i32>, the pmaddwd pattern."""
    from llvmlite import ir

    i32 = ir.IntType(32)
    half = a.type.count // 2
    even = ir.Constant(ir.VectorType(i32, half), [2 * t for t in range(half)])
    odd = ir.Constant(ir.VectorType(i32, half), [2 * t + 1 for t in range(half)])
    p = builder.mul(a, b)
    return builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))


def _prefetch(builder: Any, address: Any) -> None:
    """Prefetch ``address`` (an integer) for reading into every cache level."""
    from llvmlite import ir

    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    name = "llvm.prefetch.p0"
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name
    )
    builder.call(
        fn, [builder.inttoptr(address, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
    )
