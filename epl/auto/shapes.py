"""FLOPs and bytes of ops from their static shapes (the batch dimension given as
``rows``): what the planner reads from a built graph without running it."""

MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D")


def elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def dims(t, rows):
    """A tensor's static shape, ``rows`` for an unknown dimension (None: no rank)."""
    return [rows if d is None else int(d) for d in t.shape.as_list()] \
        if t.shape.rank is not None else None


def nbytes(t, rows):
    """A tensor's bytes at ``rows`` rows (0: unknown rank)."""
    shape = dims(t, rows)
    if shape is None:
        return 0
    return elements(shape) * t.dtype.size


def op_flops(op, rows):
    """Multiply-add FLOPs (2 per multiply-add) of a matrix product from static shapes."""
    t = op.type
    out = dims(op.outputs[0], rows)
    if out is None:
        return 0.0
    if t == "MatMul":
        a = dims(op.inputs[0], rows)
        k = a[0] if op.get_attr("transpose_a") else a[1]
        return 2.0 * out[0] * out[1] * k
    if t.startswith("BatchMatMul"):
        a = dims(op.inputs[0], rows)
        adj = op.get_attr("adj_x") if "adj_x" in op.node_def.attr else False
        k = a[-2] if adj else a[-1]
        return 2.0 * elements(out) * k
    if t == "Einsum":
        eq = op.get_attr("equation").decode().replace(" ", "")
        ins = eq.split("->")[0].split(",")
        sizes = {}
        for letters, tensor in zip(ins, op.inputs):
            shape = dims(tensor, rows)
            if shape is None or "." in letters or len(letters) != len(shape):
                return 0.0
            sizes.update(zip(letters, shape))
        return 2.0 * elements(sizes.values())
    if t == "Conv2D":
        w = dims(op.inputs[1], rows)
        return 2.0 * elements(out) * w[0] * w[1] * w[2]
    return 0.0


def smallest_dim(op, rows):
    """The smallest of a product's M, K, N (a convolution's as the product of its
    unfolded patches: batch x output pixels, kernel area x input depth, output
    depth); thin products run below the device's peak (``Device.product_share``)."""
    out = dims(op.outputs[0], rows)
    a = dims(op.inputs[0], rows)
    if not out or not a:
        return 1 << 30
    if op.type == "MatMul":
        k = a[0] if op.get_attr("transpose_a") else a[1]
        return min(out[0], out[1], k)
    if op.type.startswith("BatchMatMul") and len(out) >= 2:
        adj = op.get_attr("adj_x") if "adj_x" in op.node_def.attr else False
        return min(out[-2], out[-1], a[-2] if adj else a[-1])
    if op.type == "Conv2D" and len(out) == 4:
        w = dims(op.inputs[1], rows)
        return min(out[0] * out[1] * out[2], w[0] * w[1] * w[2], out[3])
    return 1 << 30
