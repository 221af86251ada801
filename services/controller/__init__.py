"""The controller service: the only owner of state and policy."""
