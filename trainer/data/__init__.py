"""Training data for the trainer: readers, tokenisation and batching (`trainer.data.sft` for chat SFT)."""
