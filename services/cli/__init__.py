"""replicactl: the command line client of the controller's public API."""
