"""The load balancer: one HTTP endpoint per service, routed over its ready replicas."""
