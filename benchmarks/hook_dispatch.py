"""Cost of hook dispatch per stage: prints JSON lines, one per configuration.

Measures ``HookRegistryMixin._call_hooks(stage, ctx)`` for a stage with 0, 1
and 5 no-op hooks, with 10 more hooks registered at other stages (which the
per-stage table must make irrelevant). For contrast it also times a
reference-style dispatch that builds a context and scans every hook on each
call, and one bare call of a no-op hook (the floor for each hook that runs).

Usage: ``python benchmarks/hook_dispatch.py [--iterations N] [--repeats R]``
"""

from __future__ import annotations

import argparse
import json
import platform
import timeit

from nvalchemi.hooks.context import TrainContext
from nvalchemi.hooks.registry import HookRegistryMixin
from nvalchemi.training.stages import TrainingStage

STAGE = TrainingStage.AFTER_OPTIMIZER_STEP
OTHER = TrainingStage.BEFORE_FORWARD
OTHER_STAGE_HOOKS = 10


class NoOpHook:
    frequency = 1

    def __init__(self, stage: TrainingStage) -> None:
        self.stage = stage

    def __call__(self, ctx: TrainContext, stage: TrainingStage) -> None:
        pass


class Engine(HookRegistryMixin):
    _stage_type = TrainingStage

    def __init__(self, n_hooks: int) -> None:
        self.step_count = 0
        hooks = [NoOpHook(STAGE) for _ in range(n_hooks)]
        hooks += [NoOpHook(OTHER) for _ in range(OTHER_STAGE_HOOKS)]
        self._init_hooks(hooks)

    def reference_style(self, stage: TrainingStage, batch: object) -> None:
        """Build a context per call and test every hook's stage (what we avoid)."""
        ctx = TrainContext(batch=batch, workflow=self, step_count=self.step_count)
        for hook in self.hooks:
            runs_on = getattr(hook, "_runs_on_stage", None)
            if runs_on is not None:
                if not runs_on(stage):
                    continue
            elif stage != hook.stage:
                continue
            if self.step_count % hook.frequency == 0:
                hook(ctx, stage)


def ns_per_call(stmt: str, namespace: dict, iterations: int, repeats: int) -> float:
    """Best-of-``repeats`` nanoseconds per execution of ``stmt``."""
    timer = timeit.Timer(stmt, globals=namespace)
    return min(timer.repeat(repeat=repeats, number=iterations)) / iterations * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for n_hooks in (0, 1, 5):
        engine = Engine(n_hooks)
        namespace = {
            "call": engine._call_hooks,
            "reference": engine.reference_style,
            "noop": NoOpHook(STAGE),
            "stage": STAGE,
            "ctx": TrainContext(batch=None, workflow=engine),
        }
        ours = ns_per_call("call(stage, ctx)", namespace, args.iterations, args.repeats)
        ref = ns_per_call("reference(stage, None)", namespace, args.iterations, args.repeats)
        one_call = ns_per_call("noop(ctx, stage)", namespace, args.iterations, args.repeats)
        print(
            json.dumps(
                {
                    "benchmark": "hook_dispatch",
                    "hooks_at_stage": n_hooks,
                    "hooks_at_other_stages": OTHER_STAGE_HOOKS,
                    "ns_per_dispatch": round(ours, 1),
                    "reference_style_ns_per_dispatch": round(ref, 1),
                    "ns_per_bare_hook_call": round(one_call, 1),
                    "iterations": args.iterations,
                    "python": platform.python_version(),
                }
            )
        )


if __name__ == "__main__":
    main()
