"""Op type names that differ between TensorFlow lines.

A program's ops are the same on both lines, but what some of its Python calls lower to is
not: ``tf.einsum`` builds reshapes around ``MatMul`` / ``BatchMatMulV2`` on TensorFlow 1.15
(its Python lowering) and one fused ``Einsum`` op on 2.x.  EPL's passes that look for
ops by type (AMP's float16 allow list, the split's "compute-heavy op left unsplit"
warning) ask here, so an einsum is treated the same way on both lines.
"""
from epl.tf_adapter.version import IS_TF2

# Dense products of float tensors that every line builds (tf.matmul, tf.layers.dense,
# keras Dense, batched matmuls), each with one type attribute ``T``.
_PRODUCTS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2"])

# tf.einsum's own op (2.x lowers every einsum to it; it has the type attribute ``T``, a
# float16 / bfloat16 CPU kernel and a gradient there).  On 1.15 the op exists without a
# gradient and tf.einsum never builds it: its products are the _PRODUCTS above.
_EINSUM = frozenset(["Einsum"]) if IS_TF2 else frozenset()


def matrix_products():
    """The op types of the matrix products a program's ``tf.matmul``, dense layers and
    ``tf.einsum`` calls lower to on this line (each with one type attribute ``T``)."""
    return _PRODUCTS | _EINSUM


def einsum_products():
    """The op types that compute ``tf.einsum``'s products on this line (what an einsum
    sharded by ``epl.split`` runs once per shard)."""
    return _EINSUM or frozenset(["MatMul", "BatchMatMulV2"])


_KERNELS = {}


def has_kernel(op_type, dtype, device_type):
    """TensorFlow has a kernel of ``op_type`` for ``dtype`` (its attribute ``T``) on
    ``device_type`` ("CPU" / "GPU"): e.g. TF 1.15's CPU has bfloat16 MatMul but not
    BatchMatMulV2 or Conv2D.  True when the registry cannot be read (then TensorFlow
    says so at run time)."""
    key = (op_type, dtype, device_type)
    if key not in _KERNELS:
        try:
            from tensorflow.python.framework import kernels
            registered = kernels.get_registered_kernels_for_op(op_type).kernel
        except Exception:  # pylint: disable=broad-except
            _KERNELS[key] = True
            return True
        found = False
        for kernel in registered:
            if kernel.device_type != device_type:
                continue
            limits = [c for c in kernel.constraint if c.name == "T"]
            if not limits or dtype.as_datatype_enum in limits[0].allowed_values.list.type:
                found = True
                break
        _KERNELS[key] = found
    return _KERNELS[key]
