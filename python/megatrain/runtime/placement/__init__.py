"""Placement across the tiers: device-state layers, the host store, the disk tier; the estimate."""
