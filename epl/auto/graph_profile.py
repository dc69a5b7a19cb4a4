"""What the planner reads from a model: the TF1 graph is built (never run) and its ops
give the FLOPs, parameters, optimizer slots and activations of each repeated block.

``profile(model_fn, dataset_fn, optimizer_fn)`` builds the forward pass, the optimizer
(``minimize``: the backward pass and the slot variables) in a fresh ``tf.Graph`` and
returns a ``Profile``: three kinds of *regions*: ``pre`` (before the first block: the
embedding), the blocks (name scopes ``layer_<i>``, ``block_<i>``, ``h_<i>``...), and
``post`` (after the last block: the head and the loss).  Figures that grow with the
batch are per row (the graph's batch is its first input's first dimension), so a graph
built with a small batch prices any batch, and a model built with a few blocks prices
any number of them (``Profile.layers``: the built blocks are templates).

Tensor parallelism is read from the graph too (Megatron's pattern): starting from a
replicated block input, a product with a weight whose input is replicated is
column-parallel (its output is sharded), one whose input is sharded is row-parallel (its
output is summed by an all-reduce); other ops shard their output when an input is.
"""
import json
import re

import tensorflow as tf

from epl import ir
from epl.auto import liveness, product_timing, shapes, shards, step_graph
from epl.features import auto_stages
from epl.tf_adapter import graph as tfg, grappler

v1 = tf.compat.v1

BLOCK_PATTERN = r"(?:^|/)(?:layer|layers|block|blocks|h|transformer_block|decoder_layer|" \
                r"encoder_layer)_?(\d+)(?:/|$)"
_MATMULS = shapes.MATMULS
_UNSPLIT = ("Conv2D",)      # products EPL's split does not shard (docs/split.md)
_VARIABLES = ("VariableV2", "VarHandleOp", "Variable")
_PASS = ("Identity", "ReadVariableOp", "Cast", "Enter", "Reshape", "Transpose")
_VIEWS = ("Reshape", "Identity", "Squeeze", "ExpandDims", "StridedSlice", "Slice",
          "StopGradient", "Unpack", "Split")
_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs")
_GRAD_OF = step_graph.GRAD_OF      # a gradient op's name -> its forward op's
_GATHERS = ("GatherV2", "Gather", "ResourceGather")


class Region(object):
    """Figures of one region, per row of the batch where they scale with it."""

    def __init__(self, name):
        self.name = name
        self.flops = 0.0            # forward FLOPs of matrix products, per row
        self.flops_split = 0.0      # ... of those sharded by tensor parallelism
        self.flops_by_dim = {}      # the products' smallest dimension -> their flops/row
        # each distinct product (product_timing.signature at the built rows): [forward,
        # backward] kernels of it; the forward flops/row of products without one
        self.products = {}
        # those of them sharded by tensor parallelism: {shards.key(signature, recipe):
        # [forward, backward]} (recipe None: the pattern not read, priced 1/t)
        self.shards = {}
        self.untimed_flops = 0.0
        # the other kernels (product_timing.kernel_signature): [forward, backward] of
        # each, and the bytes per row its forward ops write (the roofline's part they
        # replace when timed)
        self.kernels = {}
        self.kernel_pointwise = {}
        self.scratch = 0            # bytes: the largest kernel scratch of its backward
        self.saved = 0.0            # bytes per row the backward pass reads (activations)
        self.saved_split = 0.0      # ... of those sharded
        self.saved_float32 = 0.0    # ... of those float32 (AMP halves them)
        self.input_bytes = 0.0      # bytes per row entering the region (kept by GC, sent)
        self.allreduce_bytes = []   # per row, each all-reduce of the forward pass
        self.pointwise = 0.0        # bytes per row written by the other ops (roofline)
        self.pointwise_split = 0.0  # ... of those sharded
        # what Megatron-LM shards and EPL's own split runs whole on the first device (a
        # tied LM head and what reads it): forward flops and pointwise bytes per row,
        # and its products' ``shards`` entries
        self.epl_whole = {"flops": 0.0, "pointwise": 0.0, "shards": {}}
        self.params = 0             # parameters (elements)
        self.params_split = 0       # ... of 2-D or larger variables (sharded by t)
        self.variables = []         # names
        self.ops = 0                # forward + backward ops per micro-batch (op overhead)

    def to_dict(self):
        return {k: v for k, v in self.__dict__.items() if k != "variables"}


class Profile(object):
    """The model as the planner sees it (``profile``'s result)."""

    def __init__(self, rows, pre, blocks, post, slots_per_param, heads, built_seconds):
        self.rows = rows
        self.pre, self.blocks, self.post = pre, blocks, post
        self.slots_per_param = slots_per_param
        self.heads = heads
        self.built_seconds = built_seconds
        self.layers = len(blocks)
        self.shared = {}            # variable name -> regions using it (tied weights)
        self.cut = None             # EPL's automatic cut points (_cut_points)
        self.gc_fraction = None     # activations EPL's automatic GC holds (a share)
        self.gc_recomputed = None   # {kernel signature: count} that GC runs again
        self.step_peak = None       # updates_last -> a step's transient peak at rows
        self.split = None           # the tensors EPL's split shards (step_graph.split_share)
        self.dataflow = None        # () -> the step's ops at rows (step_graph.dataflow)
        self.built_dataflow = None  # EPL config (, model_fn) -> the same, as EPL builds it
        self.split_variants = {}    # t -> the model_fn with its own epl.split(t) scopes
        self.input_seconds = lambda: 0.0    # () -> seconds the input takes for a batch
        self.variable_sizes = []    # elements of each trainable variable, largest first
        self.restaged = None        # stage_of -> the Profile of those stages
        self._stages = {}

    def repeated(self, layers):
        """The same model with ``layers`` blocks: the built ones are templates, block
        i costs like built block i mod len(built)."""
        out = Profile(self.rows, self.pre, self.blocks, self.post, self.slots_per_param,
                      self.heads, self.built_seconds)
        out.layers = int(layers)
        out.shared = self.shared
        out.cut, out.restaged, out._stages = self.cut, self.restaged, self._stages
        out.gc_fraction = self.gc_fraction if out.layers == self.layers else None
        out.gc_recomputed = self.gc_recomputed if out.layers == self.layers else None
        out.step_peak = self.step_peak if out.layers == self.layers else None
        out.dataflow = self.dataflow if out.layers == self.layers else None
        out.built_dataflow = self.built_dataflow if out.layers == self.layers else None
        out.split_variants = self.split_variants
        out.input_seconds = self.input_seconds
        out.variable_sizes = self.variable_sizes if out.layers == self.layers else []
        return out

    def epl_stages(self, p):
        """The regions of the ``p`` stages EPL's automatic cut makes of the built model
        (``auto.auto_parallel``: contiguous, ending only at separators, the largest
        stage's cost the least), or None where that cut is not known: a model priced
        with more blocks than were built (``repeated``) or no graph at hand."""
        if self.cut is None or self.restaged is None or self.layers != len(self.blocks):
            return None
        if p not in self._stages:
            ends = auto_stages.best_split(self.cut["costs"], self.cut["cuts"], p)
            if ends is None:
                raise ValueError("epl.auto: EPL cuts this model into at most %d pipeline "
                                 "stages (its forward pass has %d places between layers)"
                                 % (len(self.cut["cuts"]) + 1, len(self.cut["cuts"])))
            stage_of, k = {}, 0
            for i, name in enumerate(self.cut["names"]):
                stage_of[name] = k
                if k < len(ends) and i == ends[k]:
                    k += 1
            self._stages[p] = self.restaged(stage_of).blocks
        return self._stages[p]

    def block(self, i):
        return self.blocks[i % len(self.blocks)]

    def params(self):
        """Parameters of the model (a weight shared by two regions counted once)."""
        dup = sum(n * (len(where) - 1) for n, where in self.shared.values())
        return self.pre.params + self.post.params - dup + sum(
            self.block(i).params for i in range(self.layers))

    def forward_flops(self, rows):
        """Forward FLOPs of matrix products over ``rows`` rows."""
        per_row = self.pre.flops + self.post.flops + sum(
            self.block(i).flops for i in range(self.layers))
        return per_row * rows


def _variable_of(tensor):
    """The variable op a tensor reads (through identities and casts), or None."""
    op = tensor.op
    for _ in range(8):
        if op.type in _VARIABLES:
            return op
        if op.type not in _PASS or not op.inputs:
            return None
        op = op.inputs[0].op
    return None


def _slots_per_param(optimizer, trainable, new_variables):
    total = sum(shapes.elements(v.shape.as_list()) for v in trainable) or 1
    if hasattr(optimizer, "get_slot_names") and hasattr(optimizer, "get_slot"):
        n = 0
        for v in trainable:
            for name in optimizer.get_slot_names():
                if optimizer.get_slot(v, name) is not None:
                    n += shapes.elements(v.shape.as_list())
        return n / float(total)
    kinds = {tuple(v.shape.as_list()) for v in trainable}
    n = sum(shapes.elements(v.shape.as_list()) for v in new_variables
            if tuple(v.shape.as_list()) in kinds)
    return n / float(total)


def _first_input(features):
    flat = tf.nest.flatten(features)
    return flat[0]


def profile(model_fn, dataset_fn, optimizer_fn, block_pattern=BLOCK_PATTERN):
    """Build the model (never run it) and read its Profile."""
    import time
    start = time.time()
    graph = tf.Graph()
    with graph.as_default():
        dataset = dataset_fn()
        features = v1.data.make_one_shot_iterator(dataset).get_next()
        first = _first_input(features)
        rows = first.shape.as_list()[0] if first.shape.rank else None
        if rows is None:
            raise ValueError("epl.auto: the dataset's batch dimension is unknown; batch with "
                             "drop_remainder=True so that shapes are static")
        n_input_ops = len(graph.get_operations())
        loss = model_fn(features)
        forward = graph.get_operations()[n_input_ops:]
        trainable = v1.trainable_variables()
        before = set(v.name for v in v1.global_variables())
        optimizer = optimizer_fn()
        train_op = optimizer.minimize(loss)
        new_vars = [v for v in v1.global_variables() if v.name not in before]
        backward = graph.get_operations()[n_input_ops + len(forward):]
        slots = _slots_per_param(optimizer, trainable, new_vars)
        prof = _read(graph, features, forward, backward, trainable, rows, block_pattern)
        prof.variable_sizes = sorted((shapes.elements(v.shape.as_list()) for v in trainable),
                                     reverse=True)
        prof.cut = _cut_points(loss)
        prof.gc_fraction, recomputed = step_graph.gc_recompute(loss, backward)
        prof.gc_recomputed = {}
        for op in recomputed:
            sig = product_timing.any_signature(op, rows)
            if sig is not None:
                prof.gc_recomputed[sig] = prof.gc_recomputed.get(sig, 0) + 1
    prof.restaged = lambda stage_of: _read(graph, features, forward, backward, trainable,
                                           rows, block_pattern, stage_of)
    step_ops = step_graph.optimized_step(graph, train_op)
    prof.step_peak = step_graph.step_peak(step_ops, rows, prof.split)
    run_ops = step_graph.optimized_step(graph, train_op, grappler.ON_CPU)
    flows = {}

    def dataflow():
        if "flow" not in flows:
            flows["flow"] = step_graph.dataflow(run_ops(), rows)
        return flows["flow"]
    prof.dataflow = dataflow

    def built_dataflow(config, model=None):
        """The dataflow of the model (or of ``model``, its split variant) as EPL builds
        it with the EPL config ``config`` (AMP's rewrite, a pipeline's stages...)."""
        key = json.dumps(config, sort_keys=True) + repr(model)
        if key not in flows:
            flows[key] = step_graph.epl_built_dataflow(
                (model or model_fn, dataset_fn, optimizer_fn), config, replicate=not model)
        return flows[key]
    prof.built_dataflow = built_dataflow

    def input_seconds():
        if "input_s" not in flows:
            flows["input_s"] = product_timing.input_seconds(dataset_fn)
        return flows["input_s"]
    prof.input_seconds = input_seconds
    prof.slots_per_param = slots
    prof.built_seconds = time.time() - start
    return prof


def _cut_points(loss):
    """What EPL's automatic pipeline cut (``auto.auto_parallel``) sees: the forward ops
    of the loss in creation order, each op's cost and the positions after which a
    stage may end (``epl.features.auto_stages``: separators, costs, ``best_split``)."""
    ops = sorted((op for op in ir.upstream([loss.op]) if not _is_input(op)), key=tfg.op_id)
    pos = dict((op, i) for i, op in enumerate(ops))
    cuts = sorted(set(pos[t.op] for t in ir.separators(ops)) - set([len(ops) - 1]))
    return dict(names=[op.name for op in ops], costs=[auto_stages.op_cost(op) for op in ops],
                cuts=cuts)


def _is_input(op):
    return op.type in ir.SOURCE_OPS or "Iterator" in op.type or op.type.endswith(
        ("Dataset", "DatasetV2"))


def _read(graph, features, forward, backward, trainable, rows, block_pattern, stage_of=None):
    """The regions' figures.  ``stage_of`` ({forward op name: stage}): regions are
    pipeline stages instead (EPL's automatic cut), every op and variable in its
    stage's region, the gradient ops in their forward op's."""
    pattern = re.compile(block_pattern)
    if stage_of is not None:
        pattern = re.compile(r"(?!x)x")          # matches nothing: no name-scope blocks
    fwd_names = set(op.name for op in forward)
    # batch-dependent forward ops: downstream of the input
    batch_ops = set(t.op.name for t in tf.nest.flatten(features))
    for op in forward:
        if any(t.op.name in batch_ops for t in op.inputs):
            batch_ops.add(op.name)
    # regions: blocks by name scope; the rest before the first block is pre, after is post
    region_of = {}
    block_ids = []
    for op in forward:
        m = pattern.search(op.name)
        if m:
            k = int(m.group(1))
            region_of[op.name] = k
            if k not in block_ids:
                block_ids.append(k)
    if stage_of is not None:
        block_ids = list(range(1 + max(stage_of.values())))
        for op in forward:
            region_of[op.name] = stage_of.get(op.name, 0)
    elif block_ids:
        first_block_ops = set(n for n, r in region_of.items() if r == block_ids[0])
        seen_first = False
        for op in forward:
            if op.name in first_block_ops:
                seen_first = True
            if op.name not in region_of:
                region_of[op.name] = "post" if seen_first and op.name in batch_ops else "pre"
    else:
        for op in forward:
            region_of[op.name] = "post"   # no blocks: the whole model is one region
    regions = {"pre": Region("pre"), "post": Region("post")}
    for k in block_ids:
        regions[k] = Region("layer_%d" % k)

    fallback = "pre" if stage_of is None else 0
    consumers = {}                # saved tensor -> regions whose backward reads it
    gradient_products = []        # (op, region, signature, forward op name)
    for op in backward:
        if op.type in _SHAPE_OPS:
            continue
        m = pattern.search(op.name)
        grad_of = _GRAD_OF.match(op.name)
        if grad_of:
            where = int(m.group(1)) if m and int(m.group(1)) in regions else \
                region_of.get(grad_of.group(1), "post" if stage_of is None else 0)
            regions[where].ops += 1
            sig = product_timing.signature(op, rows)
            if sig is not None:
                regions[where].products.setdefault(sig, [0, 0])[1] += 1
                gradient_products.append((op, where, sig, grad_of.group(1)))
            else:
                sig = product_timing.kernel_signature(op, rows)
                if sig is not None:
                    regions[where].kernels.setdefault(sig, [0, 0])[1] += 1
            regions[where].scratch = max(regions[where].scratch, liveness.scratch_bytes(op))
        for t in op.inputs:
            if t.op.name in batch_ops:
                if m and int(m.group(1)) in regions:
                    where = int(m.group(1))
                else:
                    where = region_of.get(grad_of.group(1) if grad_of else None,
                                          region_of.get(t.op.name, fallback))
                consumers.setdefault(t.name, set()).add(where)
    split = set()                 # tensor names sharded under tensor parallelism
    unsplit_vars = set()          # variables of products EPL's split keeps whole
    split_products = {}           # forward op name -> (op, shards.forward_axes or None)
    epl_split = set()             # ... under EPL's own split (the tied head whole)
    split_shapes = {}             # forward op name -> shapes of its sharded tensors
    whole_in = {}                 # ... -> shapes of its whole activation inputs
    weighted = []                 # (forward product, [(variable, shape)])
    heads = None
    var_regions = {}
    entered = set()
    gathered = set(v.name for v in (_variable_of(op.inputs[0]) for op in forward
                                    if op.type in _GATHERS) if v is not None)
    for op in forward:
        reg = regions[region_of[op.name]]
        if op.name not in batch_ops:
            continue
        reg.ops += 1
        var_inputs = [(_variable_of(t), t) for t in op.inputs]
        for var_op, _ in var_inputs:
            if var_op is not None and op.type not in _PASS:
                var_regions.setdefault(var_op.name, set()).add(region_of[op.name])
        # (across blocks too: EPL alternates a split scope's dense layers, so a block
        # that ends column-parallel hands its next one a sharded input, docs/split.md)
        in_split = any(t.name in split for t in op.inputs if t.op.name in batch_ops)
        weight = any(v is not None for v, _ in var_inputs)
        # EPL's own split runs a product of a weight an embedding gathers from whole, on
        # the first device (a tied LM head reads the shards' concatenation,
        # docs/split.md; traced: the GPT's logits whole on one device), and what reads
        # it; Megatron-LM's shards it over the vocabulary (the figures below)
        tied = op.type in _MATMULS and any(v is not None and v.name in gathered
                                           for v, _ in var_inputs)
        whole_input = in_split and not any(t.name in epl_split for t in op.inputs)
        out_split = in_split
        if op.type in _MATMULS:
            flops = shapes.op_flops(op, rows) / rows
            reg.flops += flops
            dim = shapes.smallest_dim(op, rows)
            reg.flops_by_dim[dim] = reg.flops_by_dim.get(dim, 0.0) + flops
            sig = product_timing.signature(op, rows)
            if sig is None:
                reg.untimed_flops += flops
            else:
                reg.products.setdefault(sig, [0, 0])[0] += 1
            if op.type in _UNSPLIT:     # EPL's split runs it whole, on the first device
                out_split = weight = in_split = False
                unsplit_vars.update(v.name for v, _ in var_inputs if v is not None)
            elif weight:
                out_split = not in_split
                if in_split:
                    reg.allreduce_bytes.append(shapes.nbytes(op.outputs[0], rows) / float(rows))
                reg.flops_split += flops
            elif in_split:
                reg.flops_split += flops
            if weight and not tied:
                weighted.append((op.name, [(v.name, tuple(shapes.dims(x, rows) or ()))
                                           for v, x in var_inputs if v is not None]))
            if (weight or in_split) and (tied or whole_input):
                reg.epl_whole["flops"] += flops
            if (weight or in_split) and sig is not None:
                held = [i for i, (v, _) in enumerate(var_inputs) if v is not None]
                axes = shards.forward_axes(op, held[-1] if held else None, in_split)
                split_products[op.name] = (op, axes, tied or whole_input)
                recipe = shards.forward_recipe(op, axes) if axes else None
                for kept in [reg.shards] + ([reg.epl_whole["shards"]]
                                            if tied or whole_input else []):
                    kept.setdefault(shards.key(sig, recipe), [0, 0])[0] += 1
            dims = shapes.dims(op.outputs[0], rows)
            if op.type.startswith("BatchMatMul") and dims and len(dims) == 4 and heads is None:
                heads = dims[1]
        elif op.type in _GATHERS and weight and reg.name == "pre":
            out_split = False
            reg.allreduce_bytes.append(shapes.nbytes(op.outputs[0], rows) / float(rows))
        kernel = None if op.type in _MATMULS else product_timing.kernel_signature(op, rows)
        if kernel is not None:
            reg.kernels.setdefault(kernel, [0, 0])[0] += 1
        epl_out = out_split and not (tied or whole_input)
        sharded = [t for t in op.inputs if t.name in epl_split] + \
            (list(op.outputs) if epl_out else [])
        if sharded:
            split_shapes.setdefault(op.name, set()).update(
                tuple(shapes.dims(t, rows) or ()) for t in sharded)
            # (a gradient with the shape of a whole input is that input's: whole)
            whole_in.setdefault(op.name, set()).update(
                tuple(shapes.dims(t, rows) or ()) for (v, t) in var_inputs
                if v is None and t.name not in epl_split and t.dtype.is_floating)
        for t in op.outputs:
            if out_split:
                split.add(t.name)
            if epl_out:
                epl_split.add(t.name)
            if op.type not in _MATMULS and op.type not in _VIEWS and t.dtype.is_floating:
                b = shapes.nbytes(t, rows) / float(rows)
                reg.pointwise += b
                if kernel is not None:
                    reg.kernel_pointwise[kernel] = reg.kernel_pointwise.get(kernel, 0.0) + b
                if out_split:
                    reg.pointwise_split += b
                    reg.epl_whole["pointwise"] += 0.0 if epl_out else b
            if t.name not in consumers or not t.dtype.is_floating or t.op.name not in fwd_names:
                continue
            b = shapes.nbytes(t, rows) / float(rows)
            for where in consumers[t.name]:
                saver = regions[where]
                saver.saved += b
                if out_split and where == region_of[op.name]:
                    saver.saved_split += b
                if t.dtype == tf.float32:
                    saver.saved_float32 += b
        for t in op.inputs:
            if t.op.name in batch_ops and region_of.get(t.op.name) != region_of[op.name] \
                    and t.dtype.is_floating and t.name not in entered:
                entered.add(t.name)
                reg.input_bytes += shapes.nbytes(t, rows) / float(rows)

    for op, where, sig, forward_name in gradient_products:
        if forward_name in split_products:
            fop, axes, whole = split_products[forward_name]
            recipe = shards.gradient_recipe(op, fop, axes) if axes else None
            reg = regions[where]
            for kept in [reg.shards] + ([reg.epl_whole["shards"]] if whole else []):
                kept.setdefault(shards.key(sig, recipe), [0, 0])[1] += 1

    shared = {}
    for v in trainable:
        name = v.op.name
        where = var_regions.get(name) or {region_of.get(name, fallback)}
        if stage_of is not None:       # EPL places a variable in its op's stage
            where = {region_of.get(name, 0)}
        m = pattern.search(name)
        if m and int(m.group(1)) in regions:
            where = {int(m.group(1))}
        n = shapes.elements(v.shape.as_list())
        if len(where) > 1:
            shared[name] = (n, sorted(str(w) for w in where))
        for w in where:
            regions[w].params += n
            regions[w].variables.append(name)
            if len(v.shape.as_list()) >= 2 and name not in unsplit_vars:
                regions[w].params_split += n
    blocks = [regions[k] for k in block_ids]
    prof = Profile(rows, regions["pre"], blocks, regions["post"], 0.0, heads, 0.0)
    prof.shared = shared
    for name, held in weighted:     # (a sharded weight's gradient is sharded)
        split_shapes.setdefault(name, set()).update(
            shape for var, shape in held if len(shape) >= 2 and var not in unsplit_vars)
    for name, whole in whole_in.items():
        split_shapes[name] -= whole
    prof.split = (frozenset(epl_split), split_shapes)
    return prof
