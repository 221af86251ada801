"""Effects: each driver talks to one client, reports what happened back as facts, and decides
nothing (which replica, which zone, whether to retry a failure: the domain decides)."""
