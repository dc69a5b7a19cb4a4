"""EPL's layering, checked from its source (DESIGN.md §3, docs/architecture.md).

* Imports between EPL modules point one way, down the layer order below, and form no
  cycle.  Imports inside functions count too (they hide cycles, not remove them).
* Only the TensorFlow adapter (``epl.tf_adapter``) touches TensorFlow's private
  attributes or its C API.

Both checks compare with a list of the violations known today.  The list may only
shrink: a new violation fails, and so does a listed one that is gone (delete it from the
list, so it cannot come back unnoticed).
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "epl")

# Lower layers first.  A module may import its own layer and the layers below it.
LAYERS = [
    ("adapter", ["epl.tf_adapter"]),
    ("core", ["epl.core"]),
    ("ir", ["epl.ir"]),
    ("communicators", ["epl.communicators"]),
    ("capture", ["epl.capture", "epl.features", "epl.tensor_parallel"]),
    ("rewrite", ["epl.rewrite"]),
    ("runtime", ["epl.runtime", "epl.profile", "epl.launch"]),
    ("api", ["epl", "epl.api", "epl.auto", "epl.plan"]),
]

# Known violations (none today).  Keep these empty: a new entry needs a reason here.
KNOWN_UPWARD = set()
KNOWN_CYCLE_MODULES = set()
KNOWN_PRIVATE_USE = {}


def _modules():
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                if name.endswith(".__init__"):
                    name = name[:-len(".__init__")]
                out[name] = path
    return out


def _layer(module):
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


def _imports(modules):
    """{module: set of EPL modules it imports}."""
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(open(path).read(), path)
        is_pkg = path.endswith("__init__.py")
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # "from epl import env" imports the module epl.core.process_state
                found = [base + "." + a.name if base + "." + a.name in modules else base
                         for a in node.names]
            else:
                continue
            for t in found:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):
                    targets.add(t)
        edges[name] = targets
    return edges


def _cycle_modules(edges):
    """Modules on some import cycle (Tarjan's strongly connected components)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), set(), [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.update(comp)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if _layer(m) is None)
    assert not missing, "give these modules a layer in LAYERS: %s" % missing


def test_imports_point_down_the_layers():
    edges = _imports(_modules())
    upward = set()
    for src, targets in edges.items():
        for dst in targets:
            if _layer(dst) > _layer(src):
                upward.add("%s -> %s" % (src, dst))
    new = sorted(upward - KNOWN_UPWARD)
    gone = sorted(KNOWN_UPWARD - upward)
    assert not new, "imports against the layer order (see LAYERS): %s" % new
    assert not gone, "fixed, delete from KNOWN_UPWARD: %s" % gone


def test_no_import_cycle():
    cyc = _cycle_modules(_imports(_modules()))
    new = sorted(cyc - KNOWN_CYCLE_MODULES)
    gone = sorted(KNOWN_CYCLE_MODULES - cyc)
    assert not new, "modules on an import cycle: %s" % new
    assert not gone, "no longer on a cycle, delete from KNOWN_CYCLE_MODULES: %s" % gone


def _inline_imports(path):
    """Lines of imports of EPL modules inside functions without a comment saying why."""
    src = open(path).read()
    lines = src.split("\n")
    found = []
    for fn in ast.walk(ast.parse(src, path)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    mod = getattr(node, "module", None) or node.names[0].name
                    if mod and (mod == "epl" or mod.startswith("epl.")) \
                            and "#" not in lines[node.lineno - 1]:
                        found.append(node.lineno)
    return sorted(set(found))


# Imports of EPL modules inside functions without a one-line comment saying why: none
# (imports sit at module level; a new one inside a function needs its reason on the line).
KNOWN_INLINE_IMPORTS = 0


def test_imports_inside_functions_do_not_grow():
    modules = _modules()
    total = sum(len(_inline_imports(p)) for p in modules.values())
    assert total <= KNOWN_INLINE_IMPORTS, (
        "%d imports of EPL modules inside functions (known: %d): import at module level, "
        "or say in a comment on the line why not" % (total, KNOWN_INLINE_IMPORTS))
    assert total >= KNOWN_INLINE_IMPORTS, (
        "fewer imports inside functions now (%d): lower KNOWN_INLINE_IMPORTS" % total)


# -- private TensorFlow use ------------------------------------------------------------

def _tf_private_names():
    """Private attribute names of the TensorFlow classes and modules EPL works with."""
    import importlib
    import inspect
    from epl.tf_adapter import patching
    names = set()
    owners = []
    for module_name, cls, _ in patching.POINTS.values():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owners.append(module)
        if cls and hasattr(module, cls):
            owners.append(getattr(module, cls))
    from tensorflow.python.framework import dtypes, ops, tensor_shape
    from tensorflow.python.ops import resource_variable_ops, variables
    import tensorflow as tf_root
    owners += [ops.Operation, tf_root.Tensor, ops, dtypes.DType, tensor_shape.TensorShape,
               variables.Variable, resource_variable_ops.ResourceVariable, variables]
    if hasattr(variables, "RefVariable"):
        owners.append(variables.RefVariable)
    for owner in owners:
        for cls in (inspect.getmro(owner) if inspect.isclass(owner) else (owner,)):
            names.update(n for n in getattr(cls, "__dict__", {})
                         if n.startswith("_") and not n.startswith("__"))
    for g in ops.Graph(), :
        names.update(n for n in dir(g) if n.startswith("_") and not n.startswith("__"))
    return names


def _epl_defined_names(modules):
    """Private names EPL itself defines on its own objects (attributes it stores,
    methods and class attributes of its classes).  Module-level functions do not count:
    a patch replacement named like the TensorFlow method it replaces must not hide
    calls of that method."""
    names = set()
    for path in modules.values():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ClassDef):
                names.update(f.name for f in node.body
                             if isinstance(f, (ast.FunctionDef, ast.Assign)) and hasattr(f, "name"))
                names.update(t.id for f in node.body if isinstance(f, ast.Assign)
                             for t in f.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if not (isinstance(node.value, ast.Name) and node.value.id != "self"):
                    names.add(node.attr)
    return names


_C_API_MODULES = ("pywrap_tensorflow", "pywrap_tf_session", "c_api_util", "_pywrap")


def _string(node):
    """The text of a string literal node (ast.Str before Python 3.8), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return getattr(node, "s", None) if type(node).__name__ == "Str" else None


def _private_uses(path, tf_names, epl_names):
    """(line, what) of each private TensorFlow use in one file."""
    tree = ast.parse(open(path).read(), path)
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            name = node.attr
        elif _string(node) is not None and _string(node).startswith("_") \
                and not _string(node).startswith("__"):
            name = _string(node)   # getattr(op, "_x"), a patch table naming "_x"
        if name is not None and name in tf_names and name not in epl_names:
            found.append((node.lineno, name))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(part.startswith(_C_API_MODULES) for m in mods for part in m.split(".")):
                found.append((node.lineno, "C API import"))
    return found


def _private_use_counts():
    modules = _modules()
    tf_names = _tf_private_names()
    epl_names = _epl_defined_names(modules)
    counts = {}
    for name, path in modules.items():
        if _layer(name) == 0:
            continue
        uses = _private_uses(path, tf_names, epl_names)
        if uses:
            counts[name] = uses
    return counts


def test_private_tensorflow_use_only_in_the_adapter():
    counts = _private_use_counts()
    over = {m: uses for m, uses in counts.items() if len(uses) > KNOWN_PRIVATE_USE.get(m, 0)}
    assert not over, (
        "private TensorFlow attributes / C API outside epl.tf_adapter (add a named function "
        "to the adapter instead): %s" % {m: u[:8] for m, u in over.items()})
    fewer = {m: len(counts.get(m, ())) for m, n in KNOWN_PRIVATE_USE.items()
             if len(counts.get(m, ())) < n}
    assert not fewer, "fewer private uses now, lower KNOWN_PRIVATE_USE to: %s" % fewer


def _dimension_values(path):
    """``x[i].value`` in a file: on TF 2.x (and after ``disable_eager_execution()`` alone) a
    ``TensorShape`` index is a plain int or None, with no ``.value``.  ``shape.dims[i].value``
    stays a ``Dimension`` on both lines; ``tf.compat.dimension_value(x[i])`` works on both."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if (isinstance(node, ast.Attribute) and node.attr == "value"
                and isinstance(node.value, ast.Subscript)):
            inner = node.value.value
            if not (isinstance(inner, ast.Attribute) and inner.attr == "dims"):
                out.append(node.lineno)
    return out


def test_no_dimension_value_of_a_shape_index_outside_the_adapter():
    found = {}
    for name, path in _modules().items():
        if name.startswith("epl.tf_adapter"):
            continue
        lines = _dimension_values(path)
        if lines:
            found[os.path.relpath(path, ROOT)] = lines
    assert not found, (
        "x[i].value on a TensorShape index fails on TF 2.x (an int): use "
        "tf.compat.dimension_value(x[i]) or shape.dims[i].value: %s" % found)


def _private_tf_imports(path):
    """Lines importing ``tensorflow.python`` / ``tensorflow.core`` (or ``tensorflow_core``):
    TensorFlow's private modules, which move between lines; only the adapter names them."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mods = [node.module or ""]
        else:
            continue
        if any(m.split(".")[0] in ("tensorflow", "tensorflow_core")
               and m.split(".")[1:2] in (["python"], ["core"]) for m in mods):
            out.append(node.lineno)
    return out


# tensorflow.python / tensorflow.core imports outside the adapter, per module: none.
KNOWN_PRIVATE_TF_IMPORTS = {}


def test_private_tensorflow_modules_only_in_the_adapter():
    found = {}
    for name, path in _modules().items():
        if _layer(name) == 0:
            continue
        lines = _private_tf_imports(path)
        if lines:
            found[name] = lines
    over = {m: l for m, l in found.items() if len(l) > KNOWN_PRIVATE_TF_IMPORTS.get(m, 0)}
    assert not over, ("tensorflow.python / tensorflow.core imported outside epl.tf_adapter "
                      "(give the adapter a named function instead): %s" % over)
    fewer = {m: len(found.get(m, ())) for m, n in KNOWN_PRIVATE_TF_IMPORTS.items()
             if len(found.get(m, ())) < n}
    assert not fewer, "fewer now, lower KNOWN_PRIVATE_TF_IMPORTS to: %s" % fewer


# -- the tree -----------------------------------------------------------------------------

# The modules allowed directly in epl/: the package face and epl.init.
TOP_LEVEL_MODULES = {"__init__.py", "api.py"}
MAX_LINES = 500
# Modules over MAX_LINES whose docstring says why they are one job: none today.
KNOWN_LONG = set()


def test_the_top_level_holds_only_the_face():
    found = set(f for f in os.listdir(PKG) if f.endswith(".py"))
    assert len(found) <= 6 and found <= TOP_LEVEL_MODULES, (
        "a module directly in epl/ (%s): put it in the package of its layer"
        % sorted(found - TOP_LEVEL_MODULES))


def test_every_package_says_its_job_and_layer():
    layer_names = [n for n, _ in LAYERS]
    missing = []
    for name, path in _modules().items():
        if not path.endswith("__init__.py") or name in ("epl", ):
            continue
        doc = ast.get_docstring(ast.parse(open(path).read(), path)) or ""
        if not any(("layer" in doc.lower()) and (n in doc.lower()) for n in layer_names) \
                and "adapter" not in doc.lower():
            missing.append(name)
    assert not missing, "packages whose docstring does not name their layer: %s" % missing


def test_no_module_over_500_lines():
    long = {}
    for name, path in _modules().items():
        n = sum(1 for _ in open(path))
        if n > MAX_LINES:
            long[name] = n
    new = sorted(set(long) - set(KNOWN_LONG))
    assert not new, ("modules over %d lines (split them by job, or say in KNOWN_LONG and the "
                     "module's docstring why it is one): %s" % (MAX_LINES, {m: long[m] for m in new}))
    gone = sorted(set(KNOWN_LONG) - set(long))
    assert not gone, "no longer long, delete from KNOWN_LONG: %s" % gone


def test_the_checks_can_fail(tmp_path):
    """The scanners see what they must: an upward import, a cycle, a private attribute."""
    edges = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycle_modules(edges) == {"a", "b"}
    src = tmp_path / "m.py"
    src.write_text("def f(op):\n    return op._control_outputs, getattr(op, '_id')\n"
                   "from tensorflow.python import pywrap_tensorflow\n")
    uses = _private_uses(str(src), {"_control_outputs", "_id"}, set())
    assert [u[1] for u in sorted(uses)] == ["_control_outputs", "_id", "C API import"]
    assert _layer("epl.rewrite.cloner") > _layer("epl.ir") > _layer("epl.tf_adapter.graph")
    shapes = tmp_path / "s.py"
    shapes.write_text("a = t.shape[0].value\nb = t.shape.dims[0].value\n"
                      "c = tf.TensorShape(s)[-1].value\n")
    assert _dimension_values(str(shapes)) == [1, 3]
    imports = tmp_path / "i.py"
    imports.write_text("import tensorflow as tf\nfrom tensorflow.python.ops import nest\n"
                       "import tensorflow.core.protobuf\nfrom tensorflow.compat import v1\n")
    assert _private_tf_imports(str(imports)) == [2, 3]


if __name__ == "__main__":  # pragma: no cover - prints today's lists
    edges = _imports(_modules())
    print("KNOWN_UPWARD = %r" % sorted("%s -> %s" % (s, d) for s, t in edges.items()
                                       for d in t if _layer(d) > _layer(s)))
    print("KNOWN_CYCLE_MODULES = %r" % sorted(_cycle_modules(edges)))
    print("KNOWN_PRIVATE_USE = %r" % {m: len(u) for m, u in sorted(_private_use_counts().items())})
    pytest.main([__file__, "-q"])
