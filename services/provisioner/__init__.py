"""The provisioner service."""
