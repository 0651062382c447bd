"""The strategy-agnostic runtime: Ray actors executing per-device plans."""
