"""Active learning: explore with a committee, label what it is unsure of, retrain, repeat.

``nvalchemi-training learn job.yaml`` and :func:`run_learning` run a :class:`LearnJob`
(:mod:`.spec`); the loop (:mod:`.loop`) runs its phases (:mod:`.explore`, :mod:`.select`,
:mod:`.label`, :mod:`.train`) against a store of its own (:mod:`.store`) that makes it
resumable at any moment. See ``docs/active-learning.md``.
"""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "LearnJob": ".spec",
    "read_learn_job": ".spec",
    "LearnResult": ".loop",
    "run_learning": ".loop",
    "LearnStore": ".store",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
