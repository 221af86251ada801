"""Entry point: `python -m services.cli`."""

from services.cli import main

if __name__ == "__main__":
    main.main()
