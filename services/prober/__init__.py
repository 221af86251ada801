"""The prober service."""
