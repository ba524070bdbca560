"""``HookRegistryMixin``: hook registration and a thin per-stage dispatch.

Registration does all the work: it validates a hook, calls its
``on_register`` once, and rebuilds a table ``stage -> tuple of hooks``. Dispatch
is then a dictionary lookup and a loop over only the hooks at that stage,
gated by the engine's ``step_count % hook.frequency``. It never builds a
context: the engine owns one context object and updates it in place.

Hosts (engines) provide ``step_count`` and may set the class attribute
``_stage_type`` (an ``Enum`` type or a tuple of them) to reject hooks bound to
another engine's stages. A pydantic host keeps ``hooks`` as a field; the
registry's private tables live in the instance ``__dict__`` (do not declare
them as pydantic private attributes: that would slow every dispatch).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any, ClassVar

from nvalchemi.distributed.runtime import get_rank
from nvalchemi.hooks.context import HookContext

__all__ = ["HookRegistryMixin"]

_NO_HOOKS: tuple[Any, ...] = ()


class HookRegistryMixin:
    """Mixin giving an engine ``register_hook`` and fast ``_call_hooks``.

    Example:
        >>> from enum import Enum, auto
        >>> class Stage(Enum):
        ...     START = auto()
        ...     STOP = auto()
        >>> class Engine(HookRegistryMixin):
        ...     _stage_type = Stage
        ...     def __init__(self, hooks=()):
        ...         self.step_count = 0
        ...         self._init_hooks(hooks)
        >>> class Hello:
        ...     frequency, stage = 1, Stage.START
        ...     def __call__(self, ctx, stage):
        ...         print("hello at", stage.name)
        >>> engine = Engine([Hello()])
        >>> engine._call_hooks(Stage.START, HookContext(batch=None))
        hello at START
        >>> engine.has_hooks(Stage.STOP)
        False
    """

    _stage_type: ClassVar[type[Enum] | tuple[type[Enum], ...] | None] = None

    # ----------------------------------------------------------------- registration
    def _init_hooks(self, hooks: Iterable[Any] | None = None) -> None:
        """Start from an empty registry and register ``hooks`` in order."""
        self.hooks = []
        self._rebuild_hook_table()
        for hook in hooks or ():
            self.register_hook(hook)

    def register_hook(self, hook: Any, stage: Enum | None = None) -> None:
        """Validate ``hook``, bind it to ``stage`` if given, call its ``on_register`` once, add it.

        Raises ``ValueError`` for a frequency that is not an int >= 1 or a hook
        registered twice, and ``TypeError`` for a hook without a stage, a stage
        of another engine, or a non-callable ``on_register``. On any error the
        registry and the hook's ``stage`` are left unchanged. Registering a hook
        never re-runs the ``on_register`` of hooks registered before it.
        """
        hooks = self._hook_list()
        if any(existing is hook for existing in hooks):
            raise ValueError(
                f"Hook {_hook_name(hook)} is already registered; register each hook instance once."
            )
        resolved_stage = self._validate_hook(hook, stage)
        on_register = getattr(hook, "on_register", None)
        if on_register is not None and not callable(on_register):
            raise TypeError(
                f"Hook {_hook_name(hook)}.on_register must be callable (on_register(engine)); "
                f"got {type(on_register).__name__}."
            )
        previous_stage = getattr(hook, "stage", None)
        rebind = stage is not None and previous_stage is not resolved_stage
        if rebind:
            hook.stage = resolved_stage
        try:
            if on_register is not None:
                on_register(self)
        except BaseException:
            if rebind:
                hook.stage = previous_stage
            raise
        hooks.append(hook)
        self._rebuild_hook_table()

    def unregister_hook(self, hook: Any) -> None:
        """Remove ``hook`` (by identity); ``ValueError`` if it is not registered."""
        hooks = self._hook_list()
        for index, existing in enumerate(hooks):
            if existing is hook:
                del hooks[index]
                self._rebuild_hook_table()
                return
        raise ValueError(f"Hook {_hook_name(hook)} is not registered.")

    def refresh_hooks(self) -> None:
        """Rebuild the dispatch table from ``self.hooks`` (no ``on_register`` calls).

        Call it after changing ``self.hooks`` directly, or after changing the
        answer of a hook's ``_runs_on_stage``. Engines call it once per run.
        """
        self._rebuild_hook_table()

    def _validate_hook(self, hook: Any, stage: Enum | None = None) -> Any:
        """Check ``hook`` against the protocol and this engine; return its effective stage."""
        name = _hook_name(hook)
        if not callable(hook):
            raise TypeError(f"Hook {name} is not callable; implement __call__(ctx, stage).")
        if not hasattr(hook, "frequency"):
            raise TypeError(
                f"Hook {name} has no 'frequency' attribute; set frequency = 1 to run every step."
            )
        frequency = hook.frequency
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(
                f"Hook frequency must be a positive integer; {name} has frequency={frequency!r}."
            )
        multi_stage = callable(getattr(hook, "_runs_on_stage", None))
        resolved = stage if stage is not None else getattr(hook, "stage", None)
        if resolved is None and not multi_stage:
            raise TypeError(
                f"Hook {name} has no stage assigned; set its 'stage' attribute, pass "
                "register_hook(hook, stage=...), or implement _runs_on_stage(stage)."
            )
        accepted = self._accepted_stage_types()
        if accepted and not multi_stage and not isinstance(resolved, accepted):
            accepted_names = " or ".join(t.__name__ for t in accepted)
            raise TypeError(
                f"Hook {name} is bound to stage {resolved!r} (type {type(resolved).__name__}), "
                f"but this engine only accepts {accepted_names} stages."
            )
        return resolved

    # ----------------------------------------------------------------- dispatch
    def _call_hooks(self, stage: Enum, ctx: Any) -> None:
        """Run the hooks registered at ``stage`` with the engine's prebuilt ``ctx``.

        A hook runs when ``self.step_count % hook.frequency == 0``. An exception
        from a hook propagates unchanged, with a note naming the hook and stage.
        """
        try:
            # Keyed by id(): Enum.__hash__ is Python code, id() is not (~2x faster).
            hooks = self._hook_table_by_id[id(stage)]
        except KeyError:
            hooks = self._hooks_at_stage(stage)
        if not hooks:
            return
        step = self.step_count
        try:
            for hook in hooks:
                if step % hook.frequency == 0:
                    hook(ctx, stage)
        except Exception as exc:
            _add_note(exc, f"raised by hook {_hook_name(hook)} at stage {_stage_name(stage)}")
            raise

    def _call_hooks_with_batch(self, stage: Enum, batch: Any) -> None:
        """Build a context with :meth:`_build_context` (only if needed) and dispatch."""
        if self.has_hooks(stage):
            self._call_hooks(stage, self._build_context(batch))

    def _build_context(self, batch: Any) -> HookContext:
        """Generic context: the batch, the engine's ``model``, the global rank, the engine."""
        return HookContext(
            batch=batch,
            model=getattr(self, "model", None),
            global_rank=get_rank(getattr(self, "distributed_manager", None)),
            workflow=self,
        )

    def hooks_for(self, stage: Enum) -> tuple[Any, ...]:
        """The hooks that run at ``stage``, in registration order (frequency not applied).

        Also picks up direct edits of ``self.hooks`` (appends, reassignment).
        """
        self._sync_hook_table()
        return self._hooks_at_stage(stage)

    def has_hooks(self, stage: Enum) -> bool:
        """Whether any hook runs at ``stage`` (use it to skip preparing hook-only data).

        Cheap enough for the step loop: it reads the dispatch table as
        ``_call_hooks`` does, without re-checking ``self.hooks`` for direct edits.
        """
        try:
            return bool(self._hook_table_by_id[id(stage)])
        except KeyError:
            return bool(self._hooks_at_stage(stage))

    # ----------------------------------------------------------------- internals
    def _hook_list(self) -> list[Any]:
        hooks = getattr(self, "hooks", None)
        if hooks is None:
            hooks = []
            self.hooks = hooks
        elif not isinstance(hooks, list):
            hooks = list(hooks)
            self.hooks = hooks
        return hooks

    def _accepted_stage_types(self) -> tuple[type, ...]:
        declared = getattr(self, "_stage_type", None)
        if declared is None:
            return ()
        types = declared if isinstance(declared, tuple) else (declared,)
        if not all(isinstance(t, type) for t in types):
            raise TypeError(
                f"{type(self).__name__}._stage_type must be an Enum type, a tuple of them, or "
                f"None; got {declared!r}. On a pydantic model declare it as "
                "`_stage_type: ClassVar[type[Enum]] = MyStage`."
            )
        return types

    def _rebuild_hook_table(self) -> None:
        hooks = tuple(self._hook_list())
        stages: dict[Any, None] = {}
        for stage_type in self._accepted_stage_types():
            if issubclass(stage_type, Enum):
                stages.update(dict.fromkeys(stage_type))
        for hook in hooks:
            if not callable(getattr(hook, "_runs_on_stage", None)):
                stages[hook.stage] = None
        table = {stage: _select(hooks, stage) for stage in stages}
        self._hook_snapshot = hooks
        self._hook_table = table
        # Enum members are singletons, so their id() is a safe key; other stage
        # objects (equal but distinct strings, say) only use the equality table.
        self._hook_table_by_id = {
            id(stage): selected for stage, selected in table.items() if isinstance(stage, Enum)
        }

    def _hooks_at_stage(self, stage: Any) -> tuple[Any, ...]:
        selected = self._hook_table.get(stage)
        if selected is None:
            selected = _select(self._hook_snapshot, stage)
            self._hook_table[stage] = selected
            if isinstance(stage, Enum):
                self._hook_table_by_id[id(stage)] = selected
        return selected

    def _sync_hook_table(self) -> None:
        hooks = self._hook_list()
        snapshot = getattr(self, "_hook_snapshot", None)
        if (
            snapshot is None
            or len(snapshot) != len(hooks)
            or any(a is not b for a, b in zip(snapshot, hooks))
        ):
            self._rebuild_hook_table()


def _select(hooks: tuple[Any, ...], stage: Any) -> tuple[Any, ...]:
    selected = []
    for hook in hooks:
        runs_on_stage = getattr(hook, "_runs_on_stage", None)
        if callable(runs_on_stage):
            if runs_on_stage(stage):
                selected.append(hook)
        elif hook.stage == stage:
            selected.append(hook)
    return tuple(selected) if selected else _NO_HOOKS


def _hook_name(hook: Any) -> str:
    return type(hook).__name__


def _stage_name(stage: Any) -> str:
    return getattr(stage, "name", None) or repr(stage)


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)
