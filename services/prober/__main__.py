"""Entry point: `python -m services.prober`."""

from services.prober import server

if __name__ == "__main__":
    server.main()
