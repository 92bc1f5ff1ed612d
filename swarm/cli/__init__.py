"""Command-line plumbing every command shares (``options.py``: click options made from the settings'
declarations, logging, exit codes); the commands themselves live with what they run."""
