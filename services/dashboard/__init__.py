"""The live web dashboard: a read-only page over the controller's watch streams."""
