"""Entry point: `python -m services.stack`."""

from services.stack import cli

if __name__ == "__main__":
    cli.main()
