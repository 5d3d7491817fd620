"""MKL called from inside a numba kernel: numba intrinsics that call a C function at an address
given at run time (cpu/attention.py's causal tiles call ``cblas_sgemm`` this way).

The addresses are arguments, not constants: a compiled kernel names no library, so numba's on-disk
cache stays valid across processes (a ctypes function referenced as a global would be baked in and
refuse the cache). The caller takes them from the MKL it loaded (``gemm.PackedMkl.tile_calls``):
Paddle's own, so its threads and ``MKL_CBWR`` are the engine's.
"""

from __future__ import annotations

from typing import Any

# CBLAS enum values (mkl_cblas.h).
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def sgemm_call() -> Any:  # pragma: no cover - runs in numba's compiler
    """A numba intrinsic ``sgemm(fn, trans_b, m, n, k, a, lda, b, ldb, c, ldc)``: ``C = A @ op(B)``
    through ``cblas_sgemm`` at address ``fn`` (row-major, alpha 1, beta 0; pointers as integers)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def sgemm(
        typingctx: Any,
        fn: Any,
        trans_b: Any,
        m: Any,
        n: Any,
        k: Any,
        a: Any,
        lda: Any,
        b: Any,
        ldb: Any,
        c: Any,
        ldc: Any,
    ) -> Any:
        sig = types.void(*([types.intp] * 11))

        def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
            fn, trans_b, m, n, k, a, lda, b, ldb, c, ldc = values
            i32, f32, ptr = ir.IntType(32), ir.FloatType(), ir.IntType(8).as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [i32] * 6 + [f32, ptr, i32, ptr, i32, f32, ptr, i32])
            callee = builder.inttoptr(fn, fnty.as_pointer())

            def int32(v: Any) -> Any:
                return builder.trunc(v, i32)

            def pointer(v: Any) -> Any:
                return builder.inttoptr(v, ptr)

            order, no_trans = ir.Constant(i32, ROW_MAJOR), ir.Constant(i32, NO_TRANS)
            dims = [int32(v) for v in (trans_b, m, n, k)]
            operands = [pointer(a), int32(lda), pointer(b), int32(ldb)]
            one, zero = ir.Constant(f32, 1.0), ir.Constant(f32, 0.0)
            builder.call(callee, [order, no_trans, *dims, one, *operands, zero, pointer(c), int32(ldc)])
            return context.get_dummy_value()

        return sig, codegen

    return sgemm


def threads_local_call() -> Any:  # pragma: no cover - runs in numba's compiler
    """A numba intrinsic ``threads_local(fn, n) -> previous``: ``MKL_Set_Num_Threads_Local(n)`` at
    address ``fn`` (the calling thread's MKL thread count; 0 restores the global one)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def threads_local(typingctx: Any, fn: Any, n: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
            i32 = ir.IntType(32)
            callee = builder.inttoptr(values[0], ir.FunctionType(i32, [i32]).as_pointer())
            return builder.sext(builder.call(callee, [builder.trunc(values[1], i32)]), ir.IntType(64))

        return types.intp(types.intp, types.intp), codegen

    return threads_local
