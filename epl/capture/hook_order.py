"""Named hooks in the order their declared ``after`` constraints give: the registry
behind the backward-pass hooks (``epl.capture.backward_hooks``) and the apply-path
hooks (``epl.capture.apply_hooks``).

A hook has a ``name`` and ``after``, the names of the hooks it runs after.  The order
is the topological order of those constraints, ties broken by name (so it does not
depend on which module was imported first); an unknown name or a cycle is refused when
the order is first asked for, naming the hooks.
"""


class Registry(object):
    """Hooks by name, and their order.  ``kind`` names the hooks in errors ("backward
    hook", "apply hook")."""

    kind = "hook"

    def __init__(self):
        self._hooks = {}
        self._order = None

    def register(self, hook):
        """Add ``hook``; a second hook of the same name is refused.  Returns the hook."""
        if not hook.name or not isinstance(hook.name, str):
            raise ValueError("%s needs a name (a str), got %r" % (_a(self.kind), hook.name))
        if hook.name in self._hooks and self._hooks[hook.name] is not hook:
            raise ValueError("%s named %r is already registered (%r); give the new one "
                             "another name" % (_a(self.kind), hook.name, self._hooks[hook.name]))
        self._hooks[hook.name] = hook
        self._order = None
        return hook

    def unregister(self, name):
        self._hooks.pop(name, None)
        self._order = None

    def order(self):
        """Every hook, each after those its ``after`` names (ties by name)."""
        if self._order is None:
            self._order = topological(self._hooks, self.kind)
        return list(self._order)

    def active(self, call):
        """The hooks that apply to ``call``, in order."""
        return [h for h in self.order() if h.applies(call)]


def _a(kind):
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


def topological(hooks, kind="hook"):
    """``hooks`` ({name: hook}) in the order of their ``after`` constraints, ties by
    name; ValueError naming the hooks for an unknown name or a cycle."""
    for h in sorted(hooks.values(), key=lambda h: h.name):
        unknown = [n for n in h.after if n not in hooks]
        if unknown:
            raise ValueError(
                "%s %r runs after %s, which no module registered (registered: %s); import "
                "the feature that registers it, or fix the name"
                % (kind, h.name, ", ".join(repr(n) for n in unknown), sorted(hooks)))
    waiting = {name: set(h.after) for name, h in hooks.items()}
    order = []
    while waiting:
        ready = sorted(n for n, deps in waiting.items() if not deps)
        if not ready:
            raise ValueError(
                "%ss %s each run after another of them (a cycle in their 'after' "
                "constraints): %s" % (kind, sorted(waiting), "; ".join(
                    "%r after %s" % (n, sorted(deps)) for n, deps in sorted(waiting.items()))))
        first = ready[0]
        order.append(hooks[first])
        del waiting[first]
        for deps in waiting.values():
            deps.discard(first)
    return order
