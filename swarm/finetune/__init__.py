"""Fine-tuning adapters through the swarm (``python -m swarm.finetune``): see docs/TRAINING.md."""
