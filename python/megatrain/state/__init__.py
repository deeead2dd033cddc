"""Reading and writing training state: checkpoints, the atomic directory, export, streamed loading."""
