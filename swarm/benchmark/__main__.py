"""``python -m swarm.benchmark``."""
from swarm.benchmark.commands import main
from swarm.cli.options import run_main

if __name__ == "__main__":
    run_main(main)
