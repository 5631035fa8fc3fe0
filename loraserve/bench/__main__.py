"""`python -m loraserve.bench`: the bench subcommand without the main CLI."""

from loraserve.bench.cli import main

if __name__ == "__main__":
    main()
