"""The local stack: the three services as child processes on loopback, plus an example service."""
