"""The engine: host store, device slots, copy streams, gradients and the CPU worker."""
