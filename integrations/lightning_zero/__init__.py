"""Lightning front-end for zero_strategy (in progress: see the project issues)."""
