"""Attach disttrace to training libraries' own loops: `hf` (transformers.Trainer), `lightning` (Lightning)."""
