"""Entry point: `python -m services.dashboard`."""

from services.dashboard import server

if __name__ == "__main__":
    server.main()
