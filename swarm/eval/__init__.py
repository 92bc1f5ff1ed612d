"""Evaluating models (``python -m swarm.eval``): held-out likelihood bound, masked-token accuracy, tasks.

The names below are imported on first use (:mod:`swarm.utils.lazy`), so that ``python -m swarm.eval --help``,
which imports this package first, answers before torch loads.
"""
from swarm.utils.lazy import lazy_exports

_EXPORTS = {
    "LikelihoodReport": "swarm.eval.likelihood", "evaluate_likelihood": "swarm.eval.likelihood",
    **{name: "swarm.eval.report" for name in ("EvalPlan", "ModelReport", "evaluate_model", "evaluate_models",
                                              "trained_on", "training_info")},
    "TaskGeneration": "swarm.eval.config", "TaskReport": "swarm.eval.tasks", "evaluate_task": "swarm.eval.tasks",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
