"""Training: SFT and GRPO loops, losses, optimizer and schedule, checkpoints and export, metrics."""
