"""One training loop for pretraining and finetuning: optimizer and schedules, resumable checkpoints, logging."""
