"""Process launch and torch.distributed set-up for multi-device runs."""
