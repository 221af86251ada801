"""Entry point: `python -m services.provisioner`."""

from services.provisioner import server

if __name__ == "__main__":
    server.main()
