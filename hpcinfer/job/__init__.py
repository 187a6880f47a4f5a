"""What every task's run shares: claiming the output, checks, rejects, accounting, signals, the stage pipeline."""
