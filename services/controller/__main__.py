"""Entry point: `python -m services.controller`."""

from services.controller import server

if __name__ == "__main__":
    server.main()
