"""EPL configuration: one schema drives parsing, validation, env overrides and docs.

Every key is ``"<section>.<name>"``.  Values come, in increasing priority, from
the schema default, the environment variable ``EPL_<SECTION>_<NAME>`` and the
``param_dict`` given to :class:`Config`.
"""
import collections
import os

Key = collections.namedtuple("Key", "name type default choices doc")

_INT, _STR, _BOOL, _LOSS_SCALE = "integer", "str", "bool", "integer/str"

# (key, type, default, choices or None, one-line doc).  docs/config.md is
# generated from it by `make docs` (a test checks the two are equal).
SCHEMA = [
    Key("pipeline.num_micro_batch", _INT, 1, None,
        "Number of micro-batches per model replica and iteration (pipeline or gradient accumulation)."),
    Key("pipeline.num_stages", _INT, None, None,
        "Number of pipeline stages when auto.auto_parallel is True."),
    Key("pipeline.strategy", _STR, "PreferBackward", ("PreferBackward", "PreferForward"),
        "Pipeline schedule: PreferBackward (1F1B, PipeDream-flush) or PreferForward (GPipe)."),
    Key("gradient_checkpoint.type", _STR, "", ("", "collection", "auto"),
        "How checkpoint tensors are chosen: 'collection' (user) or 'auto'."),
    Key("gradient_checkpoint.end_taskgraph", _INT, -1, None,
        "The last taskgraph index to apply GC."),
    Key("gradient_checkpoint.check_gradients", _BOOL, False, None,
        "Validate the GC gradients."),
    Key("zero.level", _STR, "", ("", "v1"),
        "ZeRO level; 'v1' partitions optimizer states and gradients."),
    Key("offload.level", _STR, "", ("", "v0"),
        "Offload level; 'v0' offloads all weights to CPU memory."),
    Key("amp.level", _STR, "", ("", "O1"),
        "Auto mixed precision level; only 'O1'."),
    Key("amp.debug_log", _BOOL, False, None, "Enable AMP debug log."),
    Key("amp.loss_scale", _LOSS_SCALE, "dynamic", None,
        "Loss scale for AMP: 'dynamic' or a number (fixed)."),
    Key("amp.dtype", _STR, "float16", ("float16", "bfloat16"),
        "Half type of AMP's products (EPL extension): 'float16', or 'bfloat16' (float32's "
        "exponent range: no overflow to skip, a loss scale is not needed)."),
    Key("optimizer.num_apply_group", _INT, 1, None,
        "Number of gradient apply groups (update parameters in groups to save memory)."),
    Key("cluster.device_place_prefer_intra_node", _BOOL, True, None,
        "Prefer placing one model replica within a node."),
    Key("cluster.run_visible_devices", _STR, "", None,
        "Visible devices for the session, e.g. '0,1'. Usually set by the scheduler."),
    Key("cluster.colocate_split_and_replicate", _BOOL, False, None,
        "Co-locate split and replicate taskgraphs on the same devices."),
    Key("cluster.device_type", _STR, "auto", ("auto", "gpu", "cpu"),
        "EPL extension: devices to train on; 'auto' = GPUs when visible, else CPU."),
    Key("cluster.devices_per_worker", _INT, 0, None,
        "EPL extension: devices per worker; 0 = all visible GPUs or 1 CPU; N>1 on CPU gives N virtual CPU devices."),
    Key("cluster.variable_copies", _STR, "auto", ("auto", "per_device", "per_worker"),
        "EPL extension: 'per_device' mirrors variables on every device; 'per_worker' keeps one "
        "copy per worker that its devices share (one update per worker); 'auto' = per_worker "
        "on CPU, per_device on GPU."),
    Key("cluster.keep_freed_host_memory", _BOOL, True, None,
        "EPL extension: keep the host memory TensorFlow frees in the process (glibc malloc's "
        "trim and mmap thresholds, epl.core.host_heap), so that a step does not fault its "
        "pages back in: CPU steps 0-18 % faster, RSS a few % higher; False leaves malloc "
        "as it is."),
    Key("communication.num_communicators", _INT, 2, None, "Number of communicators."),
    Key("communication.sparse_as_dense", _BOOL, False, None,
        "Transform sparse gradients to dense before communication."),
    Key("communication.max_splits", _INT, 5, None,
        "Max number of communication groups for tensor fusion."),
    Key("communication.fp16", _BOOL, False, None, "Enable FP16 AllReduce."),
    Key("communication.fp16_scale", _INT, 128, None, "Scale the gradients after FP16 AllReduce."),
    Key("communication.clip_after_allreduce", _BOOL, False, None,
        "Clip gradients after AllReduce: True reduces the gradients where tf.gradients returns "
        "them (clipping sees the reduced ones); False reduces them where they enter "
        "apply_gradients (each replica clips its own). See README, 'What EPL supports'."),
    Key("communication.gradients_reduce_method", _STR, "mean", ("mean", "sum"),
        "How gradients are reduced across replicas: 'mean' or 'sum' (any case)."),
    Key("communication.timeout_seconds", _INT, 600, None,
        "EPL extension: a collective whose peers do not arrive in time fails, naming them."),
    Key("io.slicing", _BOOL, False, None, "Slice the dataset files across workers."),
    Key("io.unbalanced_io_slicing", _BOOL, False, None, "Allow unbalanced dataset slicing."),
    Key("io.drop_last_files", _BOOL, False, None,
        "Partition the data files evenly and drop the last files that cannot be divided."),
    Key("auto.auto_parallel", _BOOL, False, None,
        "Whether to enable automatic parallelism (experimental)."),
    Key("profile.dir", _STR, "", None,
        "EPL extension: a folder; when set, the training steps profile.steps names are traced "
        "and each worker writes worker<k>_step<n>.trace.json there (Chrome trace; read it with "
        "`python -m epl.profile DIR`). '' = off. See docs/profiling.md."),
    Key("profile.steps", _STR, "10-12", None,
        "EPL extension: which training steps profile.dir traces: '10-12', '3', '3,5,8-9'. "
        "Step n is the run that takes global_step to n (without a global_step that "
        "advances: the n-th training run of the graph); initialization, evaluation and "
        "checkpoint runs are not steps (profile.runs traces those)."),
    Key("profile.runs", _STR, "", None,
        "EPL extension: which Session.runs of a graph profile.dir also traces, whatever "
        "they do, counted from 1 per graph, initialization and evaluation runs included "
        "('1-3', '5'; files worker<k>_run<n>.trace.json). '' = none."),
]
_BY_NAME = {k.name: k for k in SCHEMA}


def _allowed(key):
    if key.choices is not None:
        return "one of %s" % ", ".join(repr(c) for c in key.choices)
    if key.type == _LOSS_SCALE:
        return "'dynamic' or a positive number"
    if key.name == "profile.steps":
        return "step numbers from 1 and ranges, e.g. '10-12', '3' or '3,5,8-9'"
    if key.name == "profile.runs":
        return "'' (none), or run numbers from 1 and ranges, e.g. '1-3', '5' or '1,4-5'"
    return "a value of type %s" % key.type


def _convert(key, value, from_env=False):
    """Return ``value`` converted to ``key``'s type, or raise ValueError."""
    def bad(why=""):
        return ValueError("epl.Config: %r = %r is invalid%s; expected %s."
                          % (key.name, value, why, _allowed(key)))
    if value is None and key.default is None:
        return None
    if key.type == _BOOL:
        if isinstance(value, bool):
            out = value
        elif from_env and str(value).lower() in ("1", "true", "yes", "on"):
            out = True
        elif from_env and str(value).lower() in ("0", "false", "no", "off", ""):
            out = False
        else:
            raise bad()
    elif key.type == _INT:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            out = value
        elif from_env:
            try:
                out = int(value)
            except ValueError:
                raise bad()
        else:
            raise bad()
    elif key.type == _STR:
        if not isinstance(value, str):
            raise bad()
        out = value
        if key.choices is not None:
            # Case does not matter ("MEAN", "o1", "V1"), as in the original EPL.
            same = [c for c in key.choices if c.lower() == value.lower()]
            out = same[0] if same else value
    elif key.type == _LOSS_SCALE:
        if isinstance(value, str) and value.lower() == "dynamic":
            out = "dynamic"
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out = value
        elif from_env or isinstance(value, str):
            try:
                out = float(value)
            except ValueError:
                raise bad()
            out = int(out) if out == int(out) else out
        else:
            raise bad()
        if out != "dynamic" and out <= 0:
            raise bad(" (must be positive)")
    else:  # pragma: no cover - schema bug
        raise AssertionError(key.type)
    if key.choices is not None and out not in key.choices:
        raise bad()
    if key.name in _CHECKS:
        why = _CHECKS[key.name](out)
        if why:
            raise bad(" (%s)" % why)
    return out


def parse_steps(text):
    """The step (or run) numbers ``profile.steps`` (``profile.runs``) names ("10-12",
    "3", "3,5,8-9"), as a sorted list; ValueError saying what is wrong."""
    steps = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError("%r is not a number or a range like 10-12" % part)
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 1 or last < first:
            raise ValueError("%r: steps and runs count from 1 and a range goes up" % part)
        if last - first >= 10000:
            raise ValueError("%r traces %d; trace a few" % (part, last - first + 1))
        steps.update(range(first, last + 1))
    return sorted(steps)


def _check_steps(value):
    try:
        parse_steps(value)
    except ValueError as e:
        return str(e)
    return None


def _check_runs(value):
    return _check_steps(value) if value.strip() else None


# Keys whose values need more than their type: key -> check(value) -> None or why not.
_CHECKS = {"profile.steps": _check_steps, "profile.runs": _check_runs}


def _suggest(name):
    import difflib
    close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
    return (" Did you mean %r?" % close[0]) if close else ""


def env_var_name(key_name):
    section, attr = key_name.split(".", 1)
    return "EPL_%s_%s" % (section.upper(), attr.upper())


class _Section(object):
    """Attribute view of one section, e.g. ``config.pipeline.num_micro_batch``."""

    def __init__(self, config, section):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_section", section)

    def __getattr__(self, attr):
        return self._config.get("%s.%s" % (self._section, attr))

    def __setattr__(self, attr, value):
        self._config.set("%s.%s" % (self._section, attr), value)


class Config(object):
    """EPL configuration (seed 000).  ``Config({"pipeline.num_micro_batch": 4})``."""

    def __init__(self, param_dict=None, environ=None):
        if param_dict is not None and not isinstance(param_dict, dict):
            raise ValueError("epl.Config takes a dict of {'section.key': value}, got %r"
                             % type(param_dict).__name__)
        environ = os.environ if environ is None else environ
        self._values = {k.name: k.default for k in SCHEMA}
        for k in SCHEMA:
            var = env_var_name(k.name)
            if var in environ:
                try:
                    self._values[k.name] = _convert(k, environ[var], from_env=True)
                except ValueError as e:
                    raise ValueError("%s (from environment variable %s)" % (e, var))
        for name, value in (param_dict or {}).items():
            self.set(name, value)

    def set(self, name, value):
        key = _BY_NAME.get(name)
        if key is None:
            section = name.split(".", 1)[0]
            sections = sorted(set(k.name.split(".")[0] for k in SCHEMA))
            if section not in sections:
                raise ValueError("epl.Config: unknown section %r in key %r; sections are %s.%s"
                                 % (section, name, ", ".join(sections), _suggest(name)))
            raise ValueError("epl.Config: unknown key %r; keys of section %r are %s.%s"
                             % (name, section, ", ".join(k.name for k in SCHEMA
                                                         if k.name.startswith(section + ".")),
                                _suggest(name)))
        self._values[name] = _convert(key, value)

    def get(self, name):
        if name not in _BY_NAME:
            raise ValueError("epl.Config: unknown key %r.%s" % (name, _suggest(name)))
        return self._values[name]

    def __getattr__(self, section):
        if section.startswith("_"):
            raise AttributeError(section)
        if not any(k.name.startswith(section + ".") for k in SCHEMA):
            raise AttributeError("epl.Config has no section %r" % section)
        return _Section(self, section)

    def to_dict(self):
        return dict(self._values)

    def __repr__(self):
        changed = {k: v for k, v in self._values.items() if v != _BY_NAME[k].default}
        return "epl.Config(%r)" % (changed,)


def markdown():
    """The configuration reference as Markdown (docs/config.md)."""
    lines = ["# EPL configuration", "",
             "Generated from `epl/core/config.py` by `make docs`; do not edit.",
             "", "Every key can also be set by the environment variable `EPL_<SECTION>_<KEY>` "
             "(e.g. `EPL_PIPELINE_NUM_MICRO_BATCH=4`); a key given to `epl.Config` wins.", "",
             "| Param Key | Type | Default | Choices | Environment variable | Description |",
             "|---|---|---|---|---|---|"]
    for k in SCHEMA:
        choices = ", ".join(repr(c) for c in k.choices) if k.choices else ""
        lines.append("| `%s` | %s | `%r` | %s | `%s` | %s |"
                     % (k.name, k.type, k.default, choices, env_var_name(k.name), k.doc))
    return "\n".join(lines) + "\n"

