"""Seeded chaos drills against real processes: `python -m tests.chaos --seeds 11,12,13 --rounds 50`."""
