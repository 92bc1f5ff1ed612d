"""Evaluating models (``python -m swarm.eval``): held-out likelihood bound, masked-token accuracy, tasks."""
from swarm.eval.likelihood import LikelihoodReport, evaluate_likelihood
from swarm.eval.report import EvalPlan, ModelReport, evaluate_model, evaluate_models, trained_on, training_info
from swarm.eval.tasks import TaskGeneration, TaskReport, evaluate_task

__all__ = [
    "LikelihoodReport", "evaluate_likelihood", "EvalPlan", "ModelReport", "evaluate_model", "evaluate_models",
    "trained_on", "training_info", "TaskGeneration", "TaskReport", "evaluate_task",
]
