"""``python -m swarm.train.export RUN_DIR DEST``: copy a training run's model into a shippable directory.

A run directory also holds ``training_state.pt`` (float32 weights and optimiser moments, several times
the model's size), which a shipped model does not need. The export keeps ``config.json``, the weights
and ``training.json``, writing the last from the state when the run predates it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import torch

from swarm.models.checkpoint import INDEX_FILE, SINGLE_FILE
from swarm.models.config import CONFIG_FILE
from swarm.models.tokenizer import SubwordTokenizer
from swarm.train.loop import STATE_FILE, TRAINING_INFO_FILE, RunState, TrainConfig, training_info


def export_model(run_dir: str | Path, dest: str | Path) -> Path:
    """Replace ``dest`` with the model files of ``run_dir``; returns ``dest``."""
    run_dir, dest = Path(run_dir), Path(dest)
    weights = sorted(run_dir.glob("*.safetensors")) + (
        [run_dir / INDEX_FILE] if (run_dir / INDEX_FILE).exists() else []
    )
    if not (run_dir / CONFIG_FILE).exists() or not weights:
        raise FileNotFoundError(f"{run_dir} holds no checkpoint ({CONFIG_FILE} and {SINGLE_FILE})")
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.iterdir():
        if stale.is_file():
            stale.unlink()
    tokenizer = [run_dir / SubwordTokenizer.FILE] if (run_dir / SubwordTokenizer.FILE).exists() else []
    for path in [run_dir / CONFIG_FILE, *weights, *tokenizer]:
        shutil.copy2(path, dest / path.name)
    info_path = run_dir / TRAINING_INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.exists() else info_from_state(run_dir / STATE_FILE)
    (dest / TRAINING_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return dest


def info_from_state(state_path: Path) -> dict:
    """The training record of a run saved before ``training.json`` existed (wall time unknown then)."""
    state = torch.load(state_path, weights_only=False, map_location="cpu")
    cfg = TrainConfig(**{**state["train_config"], "data_files": tuple(state["train_config"].get("data_files", ()))})
    run = RunState(step=state["step"], wall_s=state.get("wall_s", 0.0), smoothed_loss=state.get("smoothed_loss"))
    info = training_info(cfg, run)
    if "wall_s" not in state:
        info["wall_s"] = None
    return info


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
def main(run_dir: str, dest: str) -> None:
    """Copy the model of RUN_DIR (config, weights, training record; not the optimiser state) to DEST."""
    path = export_model(run_dir, dest)
    click.echo(f"exported {run_dir} to {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
