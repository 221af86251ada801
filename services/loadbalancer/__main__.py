"""Entry point: `python -m services.loadbalancer`."""

from services.loadbalancer import server

if __name__ == "__main__":
    server.main()
